"""Losses and aggregation against Python-float references; gradients with float64 gradcheck."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from ds_rlhf.algos import AGG_MODES, aggregate, entropy_bonus, kl_loss, policy_loss, value_loss

B, T = 5, 7


def ref_aggregate(values, mask, mode, const_norm=None):
    rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(values, mask)]
    rows = [r for r in rows if r]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    c = const_norm if const_norm is not None else len(values[0])
    return sum(sum(r) / c for r in rows) / len(rows)


def ref_policy_token(lp, old, adv, cl, ch, dual):
    ratio = math.exp(lp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - cl), 1 + ch))
    if dual is not None and adv < 0:
        loss = min(loss, -dual * adv)
    return loss


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _map2(fn, *tensors):
    return [[fn(*vals) for vals in zip(*rows)] for rows in zip(*(t.tolist() for t in tensors))]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["right", "gaps"])
def test_aggregate_matches_reference(make_masks, mode, kind):
    mask = make_masks(B, T, seed=1)[kind]
    values = _rand(B, T, seed=2)
    expected = ref_aggregate(values.tolist(), mask.tolist(), mode)
    assert aggregate(values, mask, mode).item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    if mode == "seq-mean-token-sum-norm":
        assert aggregate(values, mask, "const-norm", const_norm=512).item() == pytest.approx(
            ref_aggregate(values.tolist(), mask.tolist(), mode, 512), rel=1e-12)


def test_aggregate_modes_differ_and_handle_empty_and_nan_padding(make_masks):
    mask = make_masks(B, T, seed=3)["right"]
    values = _rand(B, T, seed=4)
    results = {mode: aggregate(values, mask, mode).item() for mode in AGG_MODES}
    assert len({round(v, 9) for v in results.values()}) == len(AGG_MODES)
    poisoned = torch.where(mask, values, float("nan"))
    assert aggregate(poisoned, mask, "seq-mean-token-mean").item() == pytest.approx(results["seq-mean-token-mean"])
    assert aggregate(values, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_gradcheck(make_masks, mode):
    mask = make_masks(3, 4, seed=5)["gaps"]
    values = _rand(3, 4, seed=6).requires_grad_()
    assert gradcheck(lambda v: aggregate(v, mask, mode, const_norm=3.0), (values,))


CLIP_CASES = [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", CLIP_CASES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("with_is", [False, True])
def test_policy_loss_matches_reference(make_masks, clip_low, clip_high, dual_clip, agg, with_is):
    mask = make_masks(B, T, seed=7)["gaps"]
    old = -_rand(B, T, seed=8).abs()
    logp = old + _rand(B, T, seed=9, scale=0.6)
    adv = _rand(B, T, seed=10)
    is_w = _rand(B, T, seed=11).abs() if with_is else None
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, agg=agg, is_weights=is_w)
    per_tok = _map2(lambda a, b, c: ref_policy_token(a, b, c, clip_low, clip_high, dual_clip), logp, old, adv)
    if with_is:
        per_tok = [[x * w for x, w in zip(r, wr)] for r, wr in zip(per_tok, is_w.tolist())]
    assert loss.item() == pytest.approx(ref_aggregate(per_tok, mask.tolist(), agg), rel=1e-10)

    valid = [(a, b, c) for ra, rb, rc, rm in zip(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist())
             for a, b, c, m in zip(ra, rb, rc, rm) if m]
    ratios = [math.exp(a - b) for a, b, _ in valid]
    n = len(valid)
    clipped = sum(1 for (_, _, c), r in zip(valid, ratios)
                  if (c > 0 and r > 1 + clip_high) or (c < 0 and r < 1 - clip_low))
    assert clipped > 0 and metrics["clip_frac"].item() == pytest.approx(clipped / n)
    assert metrics["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / n, rel=1e-10)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(ratios) / n, rel=1e-12)
    assert metrics["ratio_max"].item() == pytest.approx(max(ratios)) and metrics["ratio_min"].item() == pytest.approx(
        min(ratios))
    if dual_clip is not None:
        dual = sum(1 for (_, _, c), r in zip(valid, ratios) if c < 0 and -c * r > -dual_clip * c)
        assert metrics["dual_clip_frac"].item() == pytest.approx(dual / n)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_policy_loss_on_policy_is_minus_mean_advantage(make_masks):
    """At ratio = 1 nothing is clipped: loss = -mean(A) and d loss / d logp = -A / n_tokens."""
    mask = make_masks(B, T, seed=12)["right"]
    logp = (-_rand(B, T, seed=13).abs()).requires_grad_()
    adv = _rand(B, T, seed=14)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    n = mask.sum().item()
    assert loss.item() == pytest.approx(-adv[mask].sum().item() / n)
    torch.testing.assert_close(logp.grad, torch.where(mask, -adv / n, 0.0))
    assert metrics["clip_frac"].item() == 0 and metrics["approx_kl"].item() == 0


def test_asymmetric_clip_and_dual_clip_gradients():
    old = torch.zeros(1, 5, dtype=torch.float64)
    ratios = torch.tensor([[1.25, 1.35, 0.85, 0.75, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, dual_clip=3.0,
                                agg="seq-mean-token-sum")
    loss.backward()
    grad = logp.grad[0].tolist()
    assert grad[0] != 0  # A > 0, 1.25 < 1 + clip_high: still learning (would be clipped at symmetric 0.2)
    assert grad[1] == 0  # A > 0, above 1 + clip_high: clipped
    assert grad[2] != 0  # A < 0, above 1 - clip_low
    assert grad[3] == 0  # A < 0, below 1 - clip_low: clipped
    assert grad[4] == 0  # A < 0, ratio 5 > dual_clip 3: loss bounded at 3 |A|, no gradient
    expected = -1.25 - 1.3 + 0.85 + 0.8 + 3.0
    assert loss.item() == pytest.approx(expected)
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", CLIP_CASES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_gradcheck(clip_low, clip_high, dual_clip, agg):
    # ratios kept away from the clip and dual-clip kinks, where finite differences are undefined
    ratios = torch.tensor([[0.5, 0.95, 1.05, 1.5], [4.0, 0.7, 1.1, 2.0], [0.6, 1.0, 1.6, 0.9]], dtype=torch.float64)
    old = -_rand(3, 4, seed=15).abs()
    logp = (old + ratios.log()).requires_grad_()
    adv = _rand(3, 4, seed=16)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    is_w = _rand(3, 4, seed=17).abs()
    fn = lambda lp: policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_clip, agg=agg, is_weights=is_w)[0]
    assert gradcheck(fn, (logp,))


def ref_value_token(v, old, ret, clip):
    err = (v - ret) ** 2
    if clip is None:
        return 0.5 * err
    v_clip = old + min(max(v - old, -clip), clip)
    return 0.5 * max(err, (v_clip - ret) ** 2)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_value_loss_matches_reference(make_masks, clip, agg):
    mask = make_masks(B, T, seed=18)["left"]
    old, returns = _rand(B, T, seed=19), _rand(B, T, seed=20)
    values = old + _rand(B, T, seed=21, scale=0.4)
    loss, metrics = value_loss(values, old, returns, mask, clip=clip, agg=agg)
    per_tok = _map2(lambda a, b, c: ref_value_token(a, b, c, clip), values, old, returns)
    assert loss.item() == pytest.approx(ref_aggregate(per_tok, mask.tolist(), agg), rel=1e-12)
    trip = [(v, o, r) for rv, ro, rr, rm in zip(values.tolist(), old.tolist(), returns.tolist(), mask.tolist())
            for v, o, r, m in zip(rv, ro, rr, rm) if m]
    rets, resid = [r for _, _, r in trip], [r - v for v, _, r in trip]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)
    assert metrics["explained_var"].item() == pytest.approx(1 - var(resid) / var(rets), rel=1e-10)
    assert metrics["value_mean"].item() == pytest.approx(sum(v for v, _, _ in trip) / len(trip))
    if clip is not None:
        n_clip = sum(1 for v, o, r in trip if (o + min(max(v - o, -clip), clip) - r) ** 2 > (v - r) ** 2)
        assert n_clip > 0 and metrics["vf_clip_frac"].item() == pytest.approx(n_clip / len(trip))


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_gradcheck(clip, agg):
    old, returns = _rand(3, 4, seed=22), _rand(3, 4, seed=23)
    steps = torch.tensor([[0.05, -0.5, 0.3, 0.1], [-0.1, 0.9, -0.35, 0.0], [0.15, -0.05, 0.6, -0.8]],
                         dtype=torch.float64)  # |step| kept away from the clip at 0.2
    values = (old + steps + 1e-3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    assert gradcheck(lambda v: value_loss(v, old, returns, mask, clip=clip, agg=agg)[0], (values,))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_entropy_bonus_reference_and_gradcheck(make_masks, agg):
    mask = make_masks(4, 5, seed=24)["gaps"]
    entropy = _rand(4, 5, seed=25).abs().requires_grad_()
    assert entropy_bonus(entropy, mask, agg).item() == pytest.approx(
        ref_aggregate(entropy.tolist(), mask.tolist(), agg), rel=1e-12)
    assert gradcheck(lambda e: entropy_bonus(e, mask, agg, const_norm=4.0), (entropy,))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_loss_reference_and_gradcheck(make_masks, kind):
    mask = make_masks(4, 5, seed=26)["right"]
    ref = -_rand(4, 5, seed=27).abs()
    logp = (ref + _rand(4, 5, seed=28, scale=0.5)).requires_grad_()
    per_tok = _map2(lambda a, b: {"k1": a - b, "k2": 0.5 * (a - b) ** 2, "k3": math.exp(b - a) - 1 + a - b}[kind],
                    logp, ref)
    loss, metrics = kl_loss(logp, ref, mask, kind, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref_aggregate(per_tok, mask.tolist(), "seq-mean-token-mean"), rel=1e-12)
    assert metrics["kl"].item() == pytest.approx(ref_aggregate(per_tok, mask.tolist(), "token-mean"), rel=1e-12)
    assert gradcheck(lambda lp: kl_loss(lp, ref, mask, kind)[0], (logp,))
