"""vLLM's KV cache as the run sizes it (`memory/kv_cache.py`): the environment variable, `rollout.kv_cache_gb`, the
automatic CPU size; the engine keywords that carry it to vLLM; and `ds-rlhf memory` / `ds-rlhf doctor --config`
reporting the same number the trainer passes."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from ds_rlhf.config import parse_config
from ds_rlhf.memory import kv_cache
from ds_rlhf.memory.kv_cache import GiB, MiB, kv_bytes_per_token, vllm_kv_cache
from ds_rlhf.memory.plan import plan_memory
from ds_rlhf.ops import memory as memory_cli
from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.vllm_mapping import kv_cache_kwargs
from ds_rlhf.run import environment

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 46080 bytes per token in float32
SMOL = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152)


@pytest.fixture
def smol_dir(tmp_path):
    LlamaConfig(**SMOL).save_pretrained(tmp_path)
    return tmp_path


def _cfg(*args):
    return parse_config(["--rollout.backend", "vllm", *args])


def test_sources_in_order():
    """VLLM_CPU_KVCACHE_SPACE (CPU), then rollout.kv_cache_gb, then on CPU the step's sequences; GPUs with the
    user's gpu_memory_utilization leave it to vLLM."""
    hf = LlamaConfig(**SMOL)
    assert kv_bytes_per_token(hf, 4) == 46080
    auto = vllm_kv_cache(_cfg(), hf, device="cpu", host_bytes=24 * GiB, env={})
    # the defaults: 8 prompts x 4 samples, a context of 256 + 128 tokens (3 blocks of 128)
    assert auto.source == "auto" and auto.bytes == 32 * 384 * 46080 and "32 sequences of 384 tokens" in auto.detail
    assert vllm_kv_cache(_cfg("--rollout.max_num_seqs", "8"), hf, device="cpu", host_bytes=24 * GiB,
                         env={}).bytes == 8 * 384 * 46080
    longer = vllm_kv_cache(_cfg("--rollout.max_new_tokens", "300"), hf, device="cpu", host_bytes=24 * GiB, env={})
    assert longer.bytes == -(-32 * 640 * 46080 // MiB) * MiB  # 556 tokens -> 5 blocks, rounded up to MiB
    capped = vllm_kv_cache(_cfg("--rollout.gpu_memory_utilization", "0.01"), hf, device="cpu",
                           host_bytes=24 * GiB, env={})
    assert capped.bytes == -(-int(0.01 * 24 * GiB) // MiB) * MiB and "capped at rollout.gpu_memory_utilization" in \
        capped.detail
    tiny_cap = vllm_kv_cache(_cfg("--rollout.gpu_memory_utilization", "0.0001"), hf, device="cpu",
                             host_bytes=GiB, env={})
    assert tiny_cap.bytes == 384 * 46080 // MiB * MiB + MiB  # never below one full sequence (vLLM refuses less)
    setting = vllm_kv_cache(_cfg("--rollout.kv_cache_gb", "1.5"), hf, device="cpu", host_bytes=24 * GiB, env={})
    assert (setting.source, setting.bytes) == ("setting", int(1.5 * GiB))
    env = vllm_kv_cache(_cfg("--rollout.kv_cache_gb", "1.5"), hf, device="cpu", host_bytes=24 * GiB,
                        env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert (env.source, env.bytes) == ("env", 2 * GiB)
    gpu = vllm_kv_cache(_cfg(), hf, device="cuda", host_bytes=24 * GiB, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert gpu.source == "work"  # GPUs size it by the work unless the user gives a share (tests/memory/test_kv_fit.py)
    users = vllm_kv_cache(_cfg("--rollout.gpu_memory_utilization", "0.3"), hf, device="cuda", host_bytes=24 * GiB,
                          env={})
    assert users.bytes == 0 and "gpu_memory_utilization=0.3" in users.detail
    assert vllm_kv_cache(_cfg("--rollout.kv_cache_gb", "3"), hf, device="cuda", host_bytes=0, env={}).bytes == 3 * GiB


def test_engine_keywords():
    """The size reaches vLLM as kv_cache_memory_bytes; a VLLM_CPU_KVCACHE_SPACE of the user's is left to vLLM; more
    than the available memory, or a vLLM without the argument, is a one-line error before vLLM starts."""
    names = {"kv_cache_memory_bytes", "model"}
    assert kv_cache_kwargs(GiB, cpu=True, version="0.32.0", arg_names=names, free=4 * GiB, env={}) == {
        "kv_cache_memory_bytes": GiB}
    assert kv_cache_kwargs(GiB, cpu=True, version="0.32.0", arg_names=names, free=4 * GiB,
                           env={"VLLM_CPU_KVCACHE_SPACE": "1"}) == {}
    assert kv_cache_kwargs(0, cpu=True, version="0.32.0", arg_names=names, free=4 * GiB, env={}) == {}
    with pytest.raises(RolloutError, match=r"KV cache of 4\.00 GiB is more than the 2\.00 GiB of memory available"):
        kv_cache_kwargs(4 * GiB, cpu=True, version="0.32.0", arg_names=names, free=2 * GiB, env={})
    with pytest.raises(RolloutError, match="no kv_cache_memory_bytes engine argument"):
        kv_cache_kwargs(GiB, cpu=False, version="0.1.0", arg_names={"model"}, free=0, env={})


def test_memory_and_doctor_report_the_runs_number(smol_dir, monkeypatch):
    """`ds-rlhf memory` plans vLLM-CPU with the KV cache the trainer passes, and fits only within the memory available
    now; `ds-rlhf doctor --config` prints that number and FAILs when it is more than the available memory."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = _cfg("--model.path", str(smol_dir))
    run = vllm_kv_cache(cfg, LlamaConfig(**SMOL), device="cpu", host_bytes=24 * GiB)
    plan = plan_memory(cfg, kind="rl", device="cpu", capacity=24 * GiB, world_size=1)
    vllm = next(r for r in plan.roles if r.role == "vllm")
    assert vllm.kv_cache == run.bytes and "auto: 32 sequences of 384 tokens" in vllm.detail
    assert plan.fits and memory_cli.check_available(plan, 64 * GiB) is plan
    short = memory_cli.check_available(plan, plan.peak)  # the peak fits, the peak plus the reserve does not
    assert not short.fits and "available now" in short.notes[-1]

    monkeypatch.setattr(environment.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096}.get(name, 24 * GiB // 4096))
    monkeypatch.setattr(environment, "available_host_bytes", lambda: 8 * GiB)
    line = environment.check_kv_cache(cfg, gpus=0)
    assert line.verdict == "ok" and line.facts["bytes"] == run.bytes and line.facts["source"] == "auto"
    monkeypatch.setattr(environment, "available_host_bytes", lambda: run.bytes - 1)
    assert environment.check_kv_cache(cfg, gpus=0).verdict == "FAIL"
    assert environment.check_kv_cache(cfg, gpus=1) is None  # GPUs: gpu_memory_utilization governs
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env_plan = plan_memory(cfg, kind="rl", device="cpu", capacity=24 * GiB)
    assert next(r for r in env_plan.roles if r.role == "vllm").kv_cache == GiB
    assert kv_cache.vllm_kv_cache(cfg, LlamaConfig(**SMOL), device="cpu", host_bytes=GiB).source == "env"
