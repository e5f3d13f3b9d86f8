"""The size of vLLM's KV cache as the run asks vLLM for it: one function for the trainer (`recipes/rl_build.py`
passes it to the engine), `ds-rlhf memory` (`plan.py`) and `ds-rlhf doctor --config`, so the three agree.

The KV cache is, in this order:

- `VLLM_CPU_KVCACHE_SPACE` (GiB) on CPU when set in the environment: vLLM reads it itself and it wins over any
  engine argument, so the plan and the doctor report it and the trainer notes it;
- `rollout.kv_cache_gb` when > 0;
- on GPUs where the user set `rollout.gpu_memory_utilization`, or under `run.max_gpu_memory_gb` (whose split picks
  that share from the same work, `split.py`), or with a disaggregated server (GPUs of its own): nothing is passed
  and vLLM sizes it from `gpu_memory_utilization` (what that share of the device leaves after its weights, warm-up
  and CUDA graphs);
- otherwise by the work (`work_kv_bytes`): the sequences one engine holds at once, each at the full context
  (`rollout.max_model_len`, else `data.max_prompt_len` + `rollout.max_new_tokens`) rounded up to vLLM's blocks, at
  the model's KV bytes per token (layers x KV heads x head size x 2 (K and V) x the bytes of the engines' dtype,
  `rollout.dtype`, auto = the trainer's). The sequences:
  `rl.prompts_per_step` x `rollout.n_samples` (x the ranks one disaggregated server serves, x the TP ranks one
  engine serves), cut over the sidecar engines by prompt (each engine its share), at most `rollout.max_num_seqs`
  when set (vLLM runs no more at once), times the batches the engine holds at once (`batches_on_engine`: one, also
  in async mode, whose collect precedes the next submit; with `rollout.partial_tokens` the carried samples of up to
  ceil(`max_new_tokens` / `partial_tokens`) calls). On GPUs x `KV_HEADROOM`, in the engines' dtype, 16-token blocks,
  at most what vLLM's default share of the device (`DEFAULT_SHARE`) leaves after the engines' weights and warm-up;
  on CPU in float32 (vLLM-CPU's dtype here), 128-token blocks, at most `rollout.gpu_memory_utilization` of the host
  memory per rank. Never less than one full-length sequence per engine (vLLM refuses less).

vLLM gets the number as `kv_cache_memory_bytes` (an `EngineArgs` field, vLLM >= 0.11: the worker allocates that
and skips its profile-based sizing; `rollout/vllm_mapping.kv_cache_kwargs`); `engine_budget.py` turns it into the
device share the engines are given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from ds_rlhf.config import RolloutConfig
from ds_rlhf.engines.memory import precision_bytes

GiB = 1024 ** 3
MiB = 1024 ** 2
ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_BLOCK_TOKENS = 128  # vLLM-CPU's block size unless one is given (vllm/platforms/cpu.py)
CPU_KV_DTYPE_BYTES = 4  # vLLM-CPU runs float32 here (rollout/vllm_adapter.py: weight sync needs it)
GPU_BLOCK_TOKENS = 16  # vLLM's KV cache block on GPUs, in tokens
KV_HEADROOM = 1.25  # GPUs: the work's KV cache x this (blocks a prefix cache keeps, vLLM's scheduling slack)
# GPUs: the work's KV cache never makes the engines take more of the device than vLLM's default share would
DEFAULT_SHARE = RolloutConfig().gpu_memory_utilization
# per engine beside its weights and KV cache, inside what vLLM takes: CUDA graphs and the non-torch bytes of its
# profiling (an assumption, not read from vLLM; the CUDA context is outside: device.VLLM_OUTSIDE_BUDGET)
VLLM_FIXED = 1 * GiB
VLLM_MAX_NUM_SEQS = 1024  # vLLM's default max_num_seqs on GPUs of 70 GiB and more (its sampler warm-up rows)


@dataclass(frozen=True)
class KVCacheSize:
    bytes: int  # 0: vLLM's own sizing (GPUs: gpu_memory_utilization)
    source: str  # "env" | "setting" | "auto" (CPU) | "work" (GPU) | "vllm"
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


def engine_warmup_bytes(profile: int, vocab: int, max_num_seqs: int = 0) -> int:
    """One GPU engine's bytes beside its weights and KV cache: its profiling forward (`profile` bytes) or its
    sampler warm-up (`max_num_seqs` rows, vLLM's 1024 when 0, of fp32 logits over `vocab` and two copies), the
    larger, plus `VLLM_FIXED`."""
    return max(profile, (max_num_seqs or VLLM_MAX_NUM_SEQS) * vocab * 4 * 3) + VLLM_FIXED


def work_kv_bytes(per_token: int, sequences: int, context: int, *, block: int, batches: int = 1,
                  headroom: float = 1.0) -> int:
    """KV bytes for `batches` x `sequences` sequences of `context` tokens (each rounded up to whole `block`-token
    blocks) at `per_token` bytes a token, x `headroom`. Pure."""
    return int(batches * sequences * math.ceil(context / block) * block * per_token * headroom)


def step_sequences(cfg, world_size: int = 1) -> int:
    """Sequences one engine generates for a step: this rank's prompts x samples (a disaggregated server: every
    rank's; tensor parallelism over ranks: the group's)."""
    r = cfg.rollout
    return cfg.rl.prompts_per_step * r.n_samples * (world_size if r.placement == "disaggregated"
                                                    else r.tensor_parallel_size)


def engines_on_device(cfg) -> int:
    """vLLM engines the run starts per GPU it samples on: the sidecar's engines, else one."""
    return cfg.rollout.sidecar_engines if cfg.rollout.placement == "sidecar" else 1


def batches_on_engine(cfg) -> int:
    """Batches an engine holds at once: one (async mode collects a batch before it submits the next); with
    `rollout.partial_tokens` the groups started in up to ceil(`max_new_tokens` / `partial_tokens`) calls."""
    r = cfg.rollout
    return math.ceil(r.max_new_tokens / r.partial_tokens) if r.partial_tokens else 1


def engine_sequences(cfg, world_size: int = 1) -> int:
    """Sequences one engine generates at once for one batch: its share of the step's prompts (the sidecar's engines
    cut the batch by prompt) x the samples, at most `rollout.max_num_seqs` when set."""
    per_prompt = step_sequences(cfg, world_size) // cfg.rl.prompts_per_step
    seqs = math.ceil(cfg.rl.prompts_per_step / engines_on_device(cfg)) * per_prompt
    return min(seqs, cfg.rollout.max_num_seqs) if cfg.rollout.max_num_seqs else seqs


def share_by_engines(cfg) -> bool:
    """On GPUs: is vLLM's share of the device the engines' own bytes (`engine_budget.py`)? Where the user left
    `rollout.gpu_memory_utilization` unset, without `run.max_gpu_memory_gb` (its split picks the share), with the
    engines on the trainer's GPU (colocated, sidecar)."""
    return (cfg.rollout.placement in ("colocated", "sidecar") and cfg.run.max_gpu_memory_gb <= 0
            and "rollout.gpu_memory_utilization" not in getattr(cfg, "given", frozenset()))


def work_sized(cfg) -> bool:
    """On GPUs: does the run size vLLM's KV cache by the work (module docstring), not by a device share?"""
    return cfg.rollout.kv_cache_gb <= 0 and share_by_engines(cfg)




def vllm_kv_cache(cfg, hf_config, *, device: str, host_bytes: int, world_size: int = 1,
                  env: Mapping[str, str] | None = None, engine_bytes: int = 0) -> KVCacheSize:
    """The KV cache the run's vLLM engines get, all engines on one device together (module docstring).
    `host_bytes`: the memory the cap is a share of (CPU: the host memory per rank; GPUs: the device's);
    `engine_bytes` (GPUs): the engines' bytes beside their KV cache (weights, warm-up, CUDA graphs)."""
    r = cfg.rollout
    env = os.environ if env is None else env
    space = env.get(ENV, "").strip()
    if device == "cpu" and space:
        return KVCacheSize(int(float(space) * GiB), "env", f"{ENV}={space} from the environment, which vLLM reads")
    if r.kv_cache_gb > 0:
        return KVCacheSize(int(r.kv_cache_gb * GiB), "setting", f"rollout.kv_cache_gb={r.kv_cache_gb:g}")
    if device != "cpu" and not work_sized(cfg):
        return KVCacheSize(0, "vllm", f"vLLM's own sizing, what rollout.gpu_memory_utilization="
                                      f"{r.gpu_memory_utilization:g} leaves after its weights, warm-up and CUDA graphs")
    cpu = device == "cpu"
    context, tp = cfg.context_len(), r.tensor_parallel_size
    per_token = kv_bytes_per_token(hf_config, CPU_KV_DTYPE_BYTES if cpu else _dtype_bytes(cfg, device), tp)
    block = CPU_BLOCK_TOKENS if cpu else GPU_BLOCK_TOKENS
    seqs, batches, engines = engine_sequences(cfg, world_size), batches_on_engine(cfg), engines_on_device(cfg)
    one = engines * work_kv_bytes(per_token, 1, context, block=block)  # a full-length sequence per engine
    work = engines * work_kv_bytes(per_token, seqs, context, block=block, batches=batches,
                                   headroom=1.0 if cpu else KV_HEADROOM)
    share = r.gpu_memory_utilization if cpu else DEFAULT_SHARE
    cap = int(share * host_bytes) - (0 if cpu else engine_bytes)
    kv = -(-max(one, min(work, cap)) // MiB) * MiB
    held = f"{batches} x {seqs}" if batches > 1 else f"{seqs}"
    detail = (f"{'auto' if cpu else 'by the work'}: {held} sequences of {context} tokens"
              + (f" on each of {engines} engines" if engines > 1 else "")
              + ("" if cpu else f", {per_token} B/token, x {KV_HEADROOM:g}"))
    if work > cap:
        where = (f"rollout.gpu_memory_utilization={share:g} of {host_bytes / GiB:.1f} GiB host memory per rank" if cpu
                 else f"what vLLM's default share ({share:g} of the {host_bytes / GiB:.1f} GiB device) leaves")
        detail += f", capped at {where}"
    return KVCacheSize(kv, "auto" if cpu else "work", detail)


def _dtype_bytes(cfg, device: str) -> int:
    """Bytes per KV value on a GPU: the engines' precision (vLLM's KV cache dtype follows it): rollout.dtype, auto =
    the trainer's (`RolloutConfig.engine_precision`; model.dtype auto planned as bf16)."""
    return precision_bytes(cfg.rollout.engine_precision(cfg.model.planned_precision(device)))


def available_host_bytes() -> int:
    """The host memory the kernel can hand out now (Linux: MemAvailable)."""
    return int(psutil.virtual_memory().available)
