"""On the CPU accelerator no DeepSpeed C++ op is JIT-built for ZeRO-Offload training or for the process group:
torch's AdamW replaces DeepSpeedCPUAdam (`cpu_adam`) and the shared-memory all-reduce (`deepspeed_shm_comm`) is
skipped. These builds cost minutes per fresh checkout on CPU; the maths is the same."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from ds_rlhf.engines.builder import build_engine, cpu_offload_adam
from tests.engines.workers import resolved

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU accelerator's path")


def test_no_shm_op_after_ensure_distributed(dist_single):
    import deepspeed.comm.comm as ds_comm

    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    port = os.environ["MASTER_PORT"]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


def test_offload_engine_uses_torch_adamw_with_warmup(dist_single):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    cfg = resolved("zero3_offload", world_size=1, lr=1e-2, warmup_steps=4, betas=(0.8, 0.9), eps=1e-6)
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and cfg["optimizer"]["type"] == "AdamW"
    engine = build_engine(model, cfg, role="actor")
    opt = engine.basic_optimizer
    assert type(opt) is torch.optim.AdamW and engine.optimizer.optimizer is opt
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.01]  # decay / no-decay groups

    lrs = []
    for _ in range(6):
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
        assert all(g["lr"] == lrs[-1] for g in opt.param_groups)  # the scheduler drives torch's AdamW
    # WarmupLR (linear, 4 steps, from 0) as DeepSpeed applies it: the lr for the next step after each step
    assert lrs == pytest.approx([0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2]), lrs

def _cfg(type_, offload=True, **params):
    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"optimizer": {"type": type_, "params": {"lr": 1e-3, "weight_decay": 0.1, **params}},
            "zero_optimization": zero}


def test_cpu_offload_adam_follows_deepspeeds_adam_mapping():
    groups = lambda: [{"params": [torch.nn.Parameter(torch.zeros(2))]}]  # noqa: E731
    assert type(cpu_offload_adam(_cfg("AdamW"), groups())) is torch.optim.AdamW
    assert type(cpu_offload_adam(_cfg("Adam"), groups())) is torch.optim.AdamW  # adam_w_mode defaults to true
    assert type(cpu_offload_adam(_cfg("Adam", adam_w_mode=False), groups())) is torch.optim.Adam  # L2 decay
    assert type(cpu_offload_adam(_cfg("AdamW", adam_w_mode=False), groups())) is torch.optim.AdamW
    assert cpu_offload_adam(_cfg("Adam", weight_decay=0.0), groups()).defaults["weight_decay"] == 0.0
    assert cpu_offload_adam(_cfg("AdamW", offload=False), groups()) is None  # no offload: DeepSpeed's choice
    assert cpu_offload_adam(_cfg("OneBitAdam"), groups()) is None
    assert cpu_offload_adam(_cfg("Lion"), groups()) is None
    assert cpu_offload_adam(_cfg("AdamW", bias_correction=False), groups()) is None  # no torch equivalent
    assert cpu_offload_adam(_cfg("AdamW", amsgrad=True), groups()) is None
