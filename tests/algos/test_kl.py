"""KL estimators (k1, k2, k3) and the fixed / adaptive KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from ds_rlhf.algos import AdaptiveKLController, FixedKLController, kl_penalty


def _ref_kl_token(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1.0 + d}[kind]


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_matches_reference(kind):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    out = kl_penalty(logp, ref, kind)
    assert out.shape == logp.shape
    expected = [[_ref_kl_token(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-10)


def test_k3_and_k2_are_non_negative_and_zero_only_at_equality():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(1000, generator=gen) * 4
    ref = torch.randn(1000, generator=gen) * 4
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()
    assert (kl_penalty(logp, logp, "k3") == 0).all()
    assert (kl_penalty(logp, ref, "k1") < 0).any()  # k1 alone can go negative


def test_estimators_expectation_under_policy_equals_true_kl():
    """Summing p(x) * k(x) over the whole support is the exact expectation: k1 and k3 are unbiased, k2 is not."""
    gen = torch.Generator().manual_seed(2)
    for scale in (0.1, 1.0):
        p = torch.softmax(torch.randn(10, generator=gen, dtype=torch.float64), 0)
        q = torch.softmax(p.log() + scale * torch.randn(10, generator=gen, dtype=torch.float64), 0)
        true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
        for kind in ("k1", "k3"):
            expectation = (p * kl_penalty(p.log(), q.log(), kind)).sum().item()
            assert abs(expectation - true_kl) < 1e-12
        k2 = (p * kl_penalty(p.log(), q.log(), "k2")).sum().item()
        if scale == 0.1:
            assert abs(k2 - true_kl) < 0.05 * true_kl  # second-order agreement for close policies


def test_max_log_ratio_keeps_k3_finite():
    logp, ref = torch.tensor([0.0, -200.0]), torch.tensor([-200.0, 0.0])
    assert not torch.isfinite(kl_penalty(logp, ref, "k3")).all()
    clamped = kl_penalty(logp, ref, "k3", max_log_ratio=10.0)
    assert torch.isfinite(clamped).all()
    torch.testing.assert_close(clamped, torch.tensor([math.exp(-10) - 1 + 10, math.exp(10) - 1 - 10]))
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctl.update(kl, 64)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_follows_ziegler_update():
    init, target, horizon = 0.1, 6.0, 10000
    ctl = AdaptiveKLController(init, target, horizon)
    expected = init
    for kl, n in [(12.0, 256), (6.0, 256), (1.0, 512), (7.0, 128), (0.0, 1000)]:
        error = min(max(kl / target - 1.0, -0.2), 0.2)
        expected = expected * (1.0 + error * n / horizon)
        assert ctl.update(kl, n) == pytest.approx(expected, rel=1e-12)
    # KL above target raises the coefficient, below lowers it, at target leaves it
    up, down, same = (AdaptiveKLController(0.1, 1.0, 100) for _ in range(3))
    up.update(2.0, 10)
    down.update(0.5, 10)
    same.update(1.0, 10)
    assert up.value > 0.1 > down.value and same.value == 0.1
    assert up.value == pytest.approx(0.1 * 1.02)  # error clipped at +0.2


def test_adaptive_controller_state_round_trip():
    ctl = AdaptiveKLController(0.2, 3.0, 500)
    ctl.update(5.0, 50)
    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctl.value, 3.0, 500.0)
    assert restored.update(1.0, 10) == ctl.update(1.0, 10)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 0.0, 10)
