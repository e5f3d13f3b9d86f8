"""vLLM's KV cache sized by the work on GPUs (`memory/kv_cache.py`, `memory/engine_budget.py`): the sizing on the
SmolLM2-135M and the bench's 0.5B Qwen2 shapes, the floor and the cap, the user's settings winning, the engine
arguments that carry the size and the share to vLLM, `ds-rlhf memory`, and the learning benchmark's planned device
peak. Planned only: config.json files, no weights, no GPU."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from ds_rlhf.config import parse_config
from ds_rlhf.memory.device import device_peak
from ds_rlhf.memory.engine_budget import apply_engine_budget, choose_engine_budget
from ds_rlhf.memory.kv_cache import GiB, MiB, kv_bytes_per_token, vllm_kv_cache, work_kv_bytes
from ds_rlhf.memory.plan import plan_memory
from ds_rlhf.ops import memory as memory_cli
from ds_rlhf.recipes import rl_build
from ds_rlhf.rollout import factory, vllm_handle
from tests.memory import smol_shape
from tests.memory.smol_shape import H100, SMOL, SMOL_WORK

smol = smol_shape.smol  # the module's fixture

ROOT = Path(__file__).resolve().parents[2]
QWEN = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            intermediate_size=4864, max_position_embeddings=4096, tie_word_embeddings=True)




def _cfg(model: str, *args: str):
    return parse_config(["--model.path", model, "--rollout.backend", "vllm", "--rl.algo", "grpo", "--rl.kl_coef", "0",
                         *args])


def _mib(n: float) -> int:
    return -(-int(n) // MiB) * MiB


def test_work_kv_bytes_on_the_135m_and_the_05b_shapes():
    """layers x KV heads x head size x 2 x 2 bytes (bf16) a token, whole 16-token blocks per sequence."""
    smol = kv_bytes_per_token(LlamaConfig(**SMOL), 2)
    assert smol == 30 * 3 * 64 * 2 * 2 == 23040
    # 32 x 8 sequences of 150 + 512 = 662 tokens -> 42 blocks = 672 tokens: 3.69 GiB
    assert work_kv_bytes(smol, 256, 662, block=16) == 256 * 672 * 23040 == 3_963_617_280
    assert work_kv_bytes(smol, 256, 662, block=16, headroom=1.25) == int(256 * 672 * 23040 * 1.25)
    qwen = kv_bytes_per_token(Qwen2Config(**QWEN), 2)
    assert qwen == 24 * 2 * 64 * 2 * 2 == 12288
    # the bench's 0.5B shape: 32 x 8 sequences of 128 + 256 tokens (24 whole blocks): 1.125 GiB, x2 for two batches
    assert work_kv_bytes(qwen, 256, 384, block=16) == 256 * 384 * 12288 == int(1.125 * GiB)
    assert work_kv_bytes(qwen, 256, 384, block=16, batches=2) == int(2.25 * GiB)


def test_the_run_sizes_its_kv_cache_by_the_work_on_a_gpu(smol):
    """The step's sequences at full context x the headroom; the sidecar's engines each their share of the prompts;
    partial rollouts hold the groups of several calls; rollout.max_num_seqs bounds what runs at once."""
    hf = LlamaConfig(**SMOL)
    one = vllm_kv_cache(_cfg(smol, *SMOL_WORK), hf, device="cuda", host_bytes=H100, engine_bytes=2 * GiB)
    assert one.source == "work" and one.bytes == _mib(256 * 672 * 23040 * 1.25)
    assert "256 sequences of 662 tokens, 23040 B/token, x 1.25" in one.detail
    two = vllm_kv_cache(_cfg(smol, *SMOL_WORK, "--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2"),
                        hf, device="cuda", host_bytes=H100, engine_bytes=2 * GiB)
    assert two.bytes == one.bytes and "128 sequences of 662 tokens on each of 2 engines" in two.detail
    partial = vllm_kv_cache(_cfg(smol, *SMOL_WORK, "--rollout.partial_tokens", "128"), hf, device="cuda",
                            host_bytes=H100, engine_bytes=2 * GiB)
    assert partial.bytes == _mib(4 * 256 * 672 * 23040 * 1.25) and "4 x 256 sequences" in partial.detail
    bounded = vllm_kv_cache(_cfg(smol, *SMOL_WORK, "--rollout.max_num_seqs", "64"), hf, device="cuda",
                            host_bytes=H100, engine_bytes=2 * GiB)
    assert bounded.bytes == _mib(64 * 672 * 23040 * 1.25)


def test_a_floor_of_one_sequence_per_engine_and_a_cap_at_the_default_share(smol):
    hf = LlamaConfig(**SMOL)
    sidecar = ("--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2")
    floor = vllm_kv_cache(_cfg(smol, *SMOL_WORK, *sidecar), hf, device="cuda", host_bytes=4 * GiB,
                          engine_bytes=3 * GiB)  # the default share of 4 GiB holds less than the engines' weights
    assert floor.bytes == _mib(2 * 672 * 23040)  # one full-length sequence per engine: vLLM refuses less
    big = ("--rl.prompts_per_step", "512", "--rollout.n_samples", "16", "--rollout.max_model_len", "8192")
    capped = vllm_kv_cache(_cfg(smol, *big), hf, device="cuda", host_bytes=H100, engine_bytes=2 * GiB)
    assert capped.bytes == _mib(0.5 * H100 - 2 * GiB) and "capped at what vLLM's default share (0.5" in capped.detail


def test_the_users_settings_win(smol):
    """The user's gpu_memory_utilization: vLLM sizes the KV cache from it (no bytes, no budget); the user's
    kv_cache_gb: that size, the share following it; a cap: the split picks the share; disaggregated: vLLM's own."""
    hf = LlamaConfig(**SMOL)
    util = _cfg(smol, *SMOL_WORK, "--rollout.gpu_memory_utilization", "0.3")
    assert vllm_kv_cache(util, hf, device="cuda", host_bytes=H100).bytes == 0
    assert choose_engine_budget(util, H100) is None
    row = next(r for r in plan_memory(util, device="cuda", capacity=H100).roles if r.role == "vllm")
    assert row.params + row.activations + row.kv_cache == int(0.3 * H100)
    setting = choose_engine_budget(_cfg(smol, *SMOL_WORK, "--rollout.kv_cache_gb", "2"), H100)
    assert (setting.kv.source, setting.kv.bytes) == ("setting", 2 * GiB)
    assert setting.fraction == math.ceil((2 * GiB + setting.engine_bytes) / H100 * 100) / 100
    for other in (("--run.max_gpu_memory_gb", "40"), ("--rollout.placement", "disaggregated")):
        cfg = _cfg(smol, *SMOL_WORK, *other)
        assert choose_engine_budget(cfg, H100) is None
        assert vllm_kv_cache(cfg, hf, device="cuda", host_bytes=H100).bytes == 0


def test_the_budget_is_the_engines_bytes_and_applying_it_keeps_the_plan(smol):
    cfg = _cfg(smol, *SMOL_WORK, "--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2")
    budget = choose_engine_budget(cfg, H100)
    assert budget.kv.source == "work" and budget.kv.bytes == _mib(256 * 672 * 23040 * 1.25)
    assert budget.fraction == math.ceil(budget.total / H100 * 100) / 100 and budget.fraction < 0.2
    line = budget.line()
    assert line.startswith("[rl] vLLM KV cache 4.61 GiB (2.31 GiB per engine), by the work: 128 sequences")
    assert f"rollout.gpu_memory_utilization {budget.fraction:g} of the 79.20 GiB device" in line
    apply_engine_budget(cfg, budget)
    assert cfg.rollout.gpu_memory_utilization == budget.fraction
    assert "rollout.gpu_memory_utilization" not in cfg.given and choose_engine_budget(cfg, H100) == budget
    row = next(r for r in plan_memory(cfg, device="cuda", capacity=H100).roles if r.role == "vllm")
    assert (row.kv_cache, row.params + row.activations) == (budget.kv.bytes, budget.engine_bytes)


def test_the_engine_arguments_carry_the_size_and_the_share(smol, monkeypatch):
    """The build's fractions on a (faked) GPU: vLLM gets the budget's share, the sidecar trainer the rest; the
    colocated engine's `LLM(...)` gets kv_cache_memory_bytes and that share; sidecar engines each their part."""
    cfg = _cfg(smol, *SMOL_WORK, "--rollout.placement", "sidecar", "--rollout.sidecar_engines", "2")
    set_fraction = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: set_fraction.append(f))
    ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device("cuda", 0), world_size=1), print=print)
    vllm_fraction, trainer, budget = rl_build._memory_fractions(ctx, "sidecar")
    assert budget is not None and vllm_fraction == budget.fraction == cfg.rollout.gpu_memory_utilization
    assert set_fraction == [trainer] and trainer == pytest.approx(1 - budget.fraction - 0.02)
    kv, line = rl_build._vllm_kv_cache(ctx, 1, budget)  # what build_parts passes as kv_cache_bytes and logs
    assert kv.bytes == budget.kv.bytes and line == budget.line()

    started = {}

    def start(self, llm_cls, kwargs):
        started.update(kwargs)
        raise RuntimeError("stop before vLLM starts")

    monkeypatch.setattr(vllm_handle, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(vllm_handle.VLLMHandle, "_start", start)
    with pytest.raises(RuntimeError, match="stop before vLLM starts"):
        factory.make_rollout_engine("vllm", "colocated", model_path=smol, dtype="bf16", max_model_len=662,
                                    gpu_memory_utilization=budget.fraction, kv_cache_bytes=budget.kv.bytes)
    assert started["kv_cache_memory_bytes"] == budget.kv.bytes
    assert started["gpu_memory_utilization"] == budget.fraction

    servers = []
    monkeypatch.setattr(factory.server_process, "spawn_servers", lambda n, **kw: [None] * n)
    monkeypatch.setattr(factory.server_client, "RemoteVLLMEngine", lambda path, **kw: servers.append(kw) or kw)
    monkeypatch.setattr(factory.sharded, "ShardedRolloutEngine", lambda engines: engines)
    factory.make_rollout_engine("vllm", "sidecar", model_path=smol, gpu_memory_utilization=budget.fraction,
                                kv_cache_bytes=budget.kv.bytes, sidecar_engines=2)
    assert [s["kv_cache_bytes"] for s in servers] == [budget.kv.bytes // 2] * 2
    assert [s["gpu_memory_utilization"] for s in servers] == [budget.fraction / 2] * 2


def test_memory_cli_shows_the_engines_kv_cache_and_the_device_peak(smol, capsys):
    args = ["--gpu-memory-gb", "79.2", "--model.path", smol, "--rollout.backend", "vllm", *SMOL_WORK]
    assert memory_cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("engines: vLLM KV cache 4.61 GiB, by the work: 256 sequences of 662 tokens")
    assert "KV cache by the work" in out and "device peak estimate (NVML, whole device):" in out
    assert memory_cli.main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    row = next(r for r in plan["roles"] if r["role"] == "vllm")
    assert plan["engine_budget"]["kv_cache_bytes"] == row["kv_cache"] == _mib(256 * 672 * 23040 * 1.25)
    assert plan["device_peak"]["device_peak_bytes"] > plan["peak"]
    assert memory_cli.main([*args, "--rollout.gpu_memory_utilization", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "engines:" not in out and "gpu_memory_utilization 0.3" in out


def test_the_learning_bench_plans_under_30_gib_by_default(smol, tmp_path, monkeypatch):
    """bench/learn.py's defaults on a GPU (SmolLM2-135M, 32 x 8, 512 new tokens, two sidecar engines), no cap: the
    engines' KV cache by the work and the whole-device peak NVML would read stays at or under 30 GiB."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "bench" / "learn.py")
    learn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learn)
    stores = {"train": tmp_path / "train", "heldout": tmp_path / "heldout"}
    argv = learn.trainer_args(learn.parse_args(["--model", smol, "--lr", "2e-5"]), smol, stores, tmp_path / "r",
                              "async", True)
    cfg = parse_config(["--rollout.backend", "vllm", *argv])
    budget = choose_engine_budget(cfg, H100)
    apply_engine_budget(cfg, budget)
    plan = plan_memory(cfg, device="cuda", capacity=H100)
    peak = device_peak(cfg, plan)
    assert budget.kv.bytes == _mib(256 * 1024 * 23040 * 1.25)  # 512-token prompt limit + 512 new tokens
    assert plan.fits and peak.total <= 30 * GiB, (budget.line(), peak)
