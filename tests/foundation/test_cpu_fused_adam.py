"""DeepSpeed's FusedAdam on the CPU accelerator runs on torch ops (ds_rlhf/cpu_fused_adam.py): no JIT build, and the
same update as torch's AdamW (mode 1) / Adam with L2 decay (mode 0), which is what DeepSpeed's CPU op computes."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf import cpu_fused_adam


def _params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in [(7, 5), (13,), (3, 4, 2)]]


def _run(opt_cls, params, steps: int, seed: int, **kwargs) -> list[torch.Tensor]:
    opt = opt_cls(params, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    return [p.detach().float().clone() for p in params]


@pytest.fixture(scope="module")
def fused_adam_cls():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam

    assert get_accelerator().device_name() == "cpu"
    assert cpu_fused_adam.install()
    return FusedAdam


@pytest.mark.parametrize(("adam_w_mode", "weight_decay"), [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_fused_adam_matches_torch(fused_adam_cls, adam_w_mode, weight_decay):
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    ours = _run(fused_adam_cls, _params(0), 6, seed=1, adam_w_mode=adam_w_mode, **hyper)
    reference = _run(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, _params(0), 6, seed=1, **hyper)
    start = _params(0)
    for got, want, before in zip(ours, reference, start, strict=True):
        assert not torch.allclose(got, before.detach())  # it moved
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_adam_bf16_params_keep_their_dtype_and_follow_fp32(fused_adam_cls):
    params = _params(2, torch.bfloat16)
    got = _run(fused_adam_cls, params, 3, seed=3, lr=1e-2)
    want = _run(torch.optim.AdamW, _params(2, torch.bfloat16), 3, seed=3, lr=1e-2, weight_decay=0.0)
    assert all(p.dtype == torch.bfloat16 for p in params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 rounding of params and state


def test_no_jit_build_and_the_op_is_ours(fused_adam_cls, tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    opt = fused_adam_cls(_params(4), lr=1e-3)
    assert opt.multi_tensor_adam is cpu_fused_adam.multi_tensor_adam
    assert get_accelerator().get_op_builder("FusedAdamBuilder")().load() is cpu_fused_adam
    assert not any(tmp_path.iterdir())  # nothing compiled


def test_native_env_keeps_deepspeeds_op(monkeypatch):
    monkeypatch.setenv(cpu_fused_adam.NATIVE_ENV, "1")
    assert not cpu_fused_adam.install()
