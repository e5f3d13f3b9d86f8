"""Rollout/trainer mismatch: truncated / masked importance weights and the metrics that reveal a broken sync."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ds_rlhf.algos import mismatch_metrics, truncated_is_weights

B, T = 6, 8


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def ref_weights(trainer, rollout, mask, cap, mode, lower, geometric):
    lower = 0.0 if lower is None else lower
    out = []
    for tr, ro, mr in zip(trainer, rollout, mask):
        n = sum(mr)
        seq_log = sum(a - b for a, b, m in zip(tr, ro, mr) if m)
        if geometric and n:
            seq_log /= n
        row = []
        for a, b, m in zip(tr, ro, mr):
            if not m:
                row.append(0.0)
                continue
            rho = math.exp(seq_log) if mode.startswith("sequence") else math.exp(a - b)
            if mode.endswith("mask"):
                row.append(rho if lower <= rho <= cap else 0.0)
            else:
                row.append(min(rho, cap))
        out.append(row)
    return out


@pytest.mark.parametrize("mode", ["token", "token_mask", "sequence", "sequence_mask"])
@pytest.mark.parametrize("lower,geometric", [(None, False), (0.5, False), (0.8, True)])
def test_is_weights_match_reference(make_masks, mode, lower, geometric):
    mask = make_masks(B, T, seed=1)["gaps"]
    rollout = -_rand(B, T, seed=2).abs()
    trainer = rollout + _rand(B, T, seed=3, scale=0.3)
    cap = 1.2
    w = truncated_is_weights(trainer, rollout, mask, cap=cap, mode=mode, lower=lower, geometric=geometric)
    expected = ref_weights(trainer.tolist(), rollout.tolist(), mask.tolist(), cap, mode, lower, geometric)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    assert not w.requires_grad and (w >= 0).all() and (w <= cap + 1e-12).all()
    if mode.endswith("mask"):
        assert (w[mask] == 0).any() and (w[mask] > 0).any()  # the case really drops some and keeps some


def test_is_weights_are_one_when_engines_agree(make_masks):
    mask = make_masks(B, T, seed=4)["right"]
    logp = -_rand(B, T, seed=5).abs()
    for mode in ("token", "token_mask", "sequence", "sequence_mask"):
        w = truncated_is_weights(logp, logp.clone(), mask, cap=2.0, mode=mode, lower=0.5)
        assert torch.equal(w, mask.to(w.dtype))


def test_sequence_weights_do_not_overflow_on_long_sequences():
    mask = torch.ones(2, 4000, dtype=torch.bool)
    rollout = torch.full((2, 4000), -2.0)
    trainer = rollout + torch.tensor([[0.5], [-0.5]])  # sequence log-ratio +-2000
    w = truncated_is_weights(trainer, rollout, mask, cap=3.0, mode="sequence")
    assert torch.isfinite(w).all() and (w[0] == 3.0).all() and (w[1] == 0).all()
    w = truncated_is_weights(trainer, rollout, mask, cap=3.0, mode="sequence_mask")
    assert (w == 0).all()


def test_mismatch_metrics_match_reference(make_masks):
    mask = make_masks(B, T, seed=6)["gaps"]
    rollout = -_rand(B, T, seed=7).abs()
    trainer = rollout + _rand(B, T, seed=8, scale=0.2)
    m = mismatch_metrics(trainer, rollout, mask, cap=1.2, lower=0.9)
    pairs = [(a, b) for ra, rb, rm in zip(trainer.tolist(), rollout.tolist(), mask.tolist())
             for a, b, k in zip(ra, rb, rm) if k]
    ratios = [math.exp(a - b) for a, b in pairs]
    n = len(pairs)
    kl = sum(math.exp(a - b) - 1 - (a - b) for a, b in pairs) / n  # k3 with d = log rollout - log trainer
    assert m["mismatch/kl_rollout_trainer"].item() == pytest.approx(kl, rel=1e-10)
    assert m["mismatch/kl_k1"].item() == pytest.approx(sum(b - a for a, b in pairs) / n, rel=1e-10)
    assert m["mismatch/ratio_mean"].item() == pytest.approx(sum(ratios) / n, rel=1e-12)
    assert m["mismatch/ratio_std"].item() == pytest.approx(float(np.std(ratios)), rel=1e-10)
    assert m["mismatch/ratio_max"].item() == pytest.approx(max(ratios))
    assert m["mismatch/ratio_min"].item() == pytest.approx(min(ratios))
    for q in (0.01, 0.05, 0.5, 0.95, 0.99):
        assert m[f"mismatch/ratio_p{round(q * 100)}"].item() == pytest.approx(float(np.quantile(ratios, q)), rel=1e-12)
    assert m["mismatch/abs_logp_diff_max"].item() == pytest.approx(max(abs(a - b) for a, b in pairs))
    assert m["mismatch/abs_logp_diff_mean"].item() == pytest.approx(sum(abs(a - b) for a, b in pairs) / n)
    assert m["mismatch/token_frac_outside"].item() == pytest.approx(sum(r > 1.2 or r < 0.9 for r in ratios) / n)
    seq_logs = [sum(a - b for a, b, k in zip(ra, rb, rm) if k)
                for ra, rb, rm in zip(trainer.tolist(), rollout.tolist(), mask.tolist()) if any(rm)]
    assert m["mismatch/seq_abs_log_ratio_max"].item() == pytest.approx(max(abs(s) for s in seq_logs))
    frac = sum(s > math.log(1.2) or s < math.log(0.9) for s in seq_logs) / len(seq_logs)
    assert m["mismatch/seq_frac_outside"].item() == pytest.approx(frac)
    assert all(v.dim() == 0 and torch.isfinite(v) for v in m.values())


def test_failed_weight_sync_is_obvious():
    """Good sync: the engines differ by kernel noise. Failed sync: the rollout engine still samples from old weights."""
    gen = torch.Generator().manual_seed(9)
    vocab, hidden = 50, 16
    h = torch.randn(B * T, hidden, generator=gen)
    w_new = torch.randn(vocab, hidden, generator=gen) / 4
    w_stale = w_new + torch.randn(vocab, hidden, generator=gen) / 4
    tokens = torch.randint(0, vocab, (B * T,), generator=gen)
    logp = lambda w: torch.log_softmax(h @ w.t(), -1).gather(1, tokens[:, None]).view(B, T)
    trainer = logp(w_new)
    mask = torch.ones(B, T, dtype=torch.bool)
    good = mismatch_metrics(trainer, trainer + 1e-3 * torch.randn(B, T, generator=gen), mask)
    bad = mismatch_metrics(trainer, logp(w_stale), mask)
    assert good["mismatch/kl_rollout_trainer"] < 1e-5 and bad["mismatch/kl_rollout_trainer"] > 0.05
    assert abs(good["mismatch/ratio_p99"] - 1) < 0.01 and abs(good["mismatch/ratio_p1"] - 1) < 0.01
    assert bad["mismatch/ratio_p99"] / bad["mismatch/ratio_p1"] > 3


def test_mismatch_metrics_with_no_valid_tokens():
    m = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), cap=2.0)
    assert m and all(v.item() == 0 for v in m.values())
    assert "mismatch/ratio_p50" in m and "mismatch/seq_frac_outside" in m
