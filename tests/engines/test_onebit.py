"""1-bit Adam in one process: compression primitives, error feedback, exact AdamW warm-up, state round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from ds_rlhf.engines.compression import CompressedAllReduce, compress, decompress, pack_signs, unpack_signs
from ds_rlhf.engines.onebit_adam import OneBitAdam, onebit_from_config


def test_sign_packing_round_trips():
    x = torch.randn(8 * 37)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_chunk_scale_is_the_mean_magnitude():
    x = torch.randn(4 * 16)
    packed, scales, approx = compress(x, 16)
    torch.testing.assert_close(scales, x.view(4, 16).abs().mean(-1))
    assert torch.equal(decompress(packed, scales, 16), approx)


def test_error_feedback_keeps_the_running_sum_unbiased():
    """With error feedback, the sum of compressed outputs tracks the sum of inputs: the gap is the (bounded)
    residual error, not something that grows with the number of steps."""
    torch.manual_seed(0)
    comm = CompressedAllReduce(1000, "cpu", chunk_size=64)
    total_in, total_out = torch.zeros(1000), torch.zeros(1000)
    for _ in range(200):
        x = torch.randn(1000) * 0.1 + 0.05
        total_in += x
        total_out += comm(x)
    gap = (total_in - total_out).abs().max().item()
    assert gap < 1.0, gap  # vs |total_in| ~ 10: bounded residual
    torch.testing.assert_close(total_in - total_out, comm.worker_error[:1000] + comm.server_error[:1000],
                               atol=1e-3, rtol=0)
    assert comm.last_stats["fp32_allreduce_bytes"] == 0  # world size 1 sends nothing


def test_warmup_is_bitwise_adamw_then_variance_freezes():
    torch.manual_seed(0)
    shapes = [(33, 7), (12,), (5, 5)]
    a = [torch.randn(s, requires_grad=True) for s in shapes]
    b = [t.detach().clone().requires_grad_() for t in a]
    ours = OneBitAdam(a, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, freeze_step=4)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(1, 7):
        for x, y in zip(a, b):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        v_before = [ours.state[p]["exp_avg_sq"].clone() for p in a] if step > 4 else None
        ours.step()
        ref.step()
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        assert same == (step <= 4), step
        if v_before is not None:
            assert all(torch.equal(ours.state[p]["exp_avg_sq"], v) for p, v in zip(a, v_before))
    assert ours.compressing and ours.last_comm["compressed"]


def test_state_dict_round_trip_and_deepspeed_probe_step():
    p = torch.nn.Parameter(torch.randn(64))
    opt = OneBitAdam([p], lr=1e-2, freeze_step=2, chunk_size=16)
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()  # DeepSpeed's fp16/bf16 wrapper does this at start-up: must not count as a step
    assert opt.global_step == 0 and torch.equal(p, before)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    # deep copies, as after a save/load: torch's load_state_dict would otherwise share the tensors
    state, errors = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.error_state_dict())
    q = torch.nn.Parameter(p.detach().clone())
    other = OneBitAdam([q], lr=1e-2, freeze_step=2, chunk_size=16)
    other.load_state_dict(state)
    other.load_error_state_dict(errors)
    assert other.global_step == 3 and other.compressing
    grad = torch.randn_like(p)
    p.grad, q.grad = grad, grad.clone()
    opt.step()
    other.step()
    assert torch.equal(p, q)


def test_config_glue_rejects_unknown_keys():
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="unknown OneBitAdam params"):
        onebit_from_config({"type": "OneBitAdam", "params": {"freeze_step": 2, "cuda_aware": True}}, params)
    with pytest.raises(ValueError, match="freeze_step"):
        onebit_from_config({"type": "OneBitAdam", "params": {"lr": 1e-3}}, params)
    with pytest.raises(ValueError, match="multiple of 8"):
        CompressedAllReduce(10, "cpu", chunk_size=12)
