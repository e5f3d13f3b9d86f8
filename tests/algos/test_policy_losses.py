"""GSPO, GSPO-token, CISPO, SAPO and GMPO against their papers' formulas written out in plain Python on a small fixed
table; gradients against the closed forms; masked tokens change nothing; each is a registered choice."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from ds_rlhf.algos import POLICY_LOSSES, cispo_loss, gmpo_loss, gspo_loss, gspo_token_loss, policy_loss, sapo_loss
from ds_rlhf.config import ConfigError, help_text, parse_config

# Two responses: row 0 has 2 valid tokens (its third position is padding), row 1 has 3. Token log-ratios
# log(pi / pi_old): row 0 = [0.3, -0.05], row 1 = [-0.2, -0.2, -0.2]. GRPO-style advantages: one value per row.
LOGP = [[-0.8, -0.5, -2.0], [-0.5, -1.2, -1.1]]
OLD = [[-1.1, -0.45, -1.0], [-0.3, -1.0, -0.9]]
ADV = [[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]]
MASK = [[1, 1, 0], [1, 1, 1]]


def _t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def _valid(row, mask_row):
    return [i for i, m in enumerate(mask_row) if m]


def seq_mean(per_seq_tokens):
    """The papers' (1/G) sum_i (1/|y_i|) sum_t, on per-row lists of valid-token values."""
    return sum(sum(r) / len(r) for r in per_seq_tokens) / len(per_seq_tokens)


def token_mean(per_seq_tokens):
    return sum(sum(r) for r in per_seq_tokens) / sum(len(r) for r in per_seq_tokens)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


# ---- the papers' formulas, one sequence at a time ---------------------------------------------------------------
def ref_gspo(cl, ch, adv=ADV, token_adv=False):
    """Zheng et al. 2025 eqs. 5-7 (and 13 with token advantages): s_i = exp(mean_t log(pi/pi_old))."""
    out = []
    for lp, old, a, m in zip(LOGP, OLD, adv, MASK):
        idx = _valid(lp, m)
        s = math.exp(sum(lp[t] - old[t] for t in idx) / len(idx))
        a_seq = sum(a[t] for t in idx) / len(idx)
        out.append([max(-(a[t] if token_adv else a_seq) * s, -(a[t] if token_adv else a_seq) * clip(s, 1 - cl, 1 + ch))
                    for t in idx])
    return out


def ref_cispo(cl, ch):
    """MiniMax-M1 eqs. 4-5: -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi."""
    return [[-clip(math.exp(lp[t] - old[t]), 1 - cl, 1 + ch) * a[t] * lp[t] for t in _valid(lp, m)]
            for lp, old, a, m in zip(LOGP, OLD, ADV, MASK)]


def ref_sapo(tau_pos, tau_neg):
    """Gao et al. 2025: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the advantage's sign; loss -f(r) A."""
    out = []
    for lp, old, a, m in zip(LOGP, OLD, ADV, MASK):
        row = []
        for t in _valid(lp, m):
            tau = tau_pos if a[t] > 0 else tau_neg
            r = math.exp(lp[t] - old[t])
            row.append(-(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * a[t])
        out.append(row)
    return out


def ref_gmpo(cl, ch):
    """Zhao et al. 2025 eq. 4: -A_i * (prod_t min(r_t A, clip(r_t, e^-cl, e^ch) A) / A)^(1/|y_i|), via |.|."""
    out = []
    for lp, old, a, m in zip(LOGP, OLD, ADV, MASK):
        idx = _valid(lp, m)
        a_seq = sum(a[t] for t in idx) / len(idx)
        prod = 1.0
        for t in idx:
            r = math.exp(lp[t] - old[t])
            prod *= abs(min(r * a_seq, clip(r, math.exp(-cl), math.exp(ch)) * a_seq))
        objective = prod ** (1 / len(idx)) * math.copysign(1.0, a_seq)
        out.append([-objective] * len(idx))  # the sequence's loss on each of its tokens
    return out


def _call(fn, agg, **kw):
    return fn(_t(LOGP, grad=True), _t(OLD), _t(ADV), _t(MASK).bool(), agg=agg, **kw)


def test_the_table_by_hand():
    """The numbers the references produce, worked by hand once (a check on the references themselves)."""
    # GSPO, clip 0.2/0.2: s_0 = e^0.125 = 1.13315 (in range), s_1 = e^-0.2 = 0.81873 (in range)
    assert seq_mean(ref_gspo(0.2, 0.2)) == pytest.approx((-0.5 * 1.1331485 + 0.8187308) / 2, rel=1e-6)
    # GSPO, clip 0.1/0.1: both clipped: -0.5 * 1.1 and -(-1) * 0.9
    assert seq_mean(ref_gspo(0.1, 0.1)) == pytest.approx((-0.55 + 0.9) / 2)
    # CISPO, cap 1.1: weights [1.1 (clipped from 1.34986), 0.95123], [0.81873] x 3
    assert token_mean(ref_cispo(0.2, 0.1)) == pytest.approx(
        (-1.1 * 0.5 * -0.8 - 0.9512294 * 0.5 * -0.5 + 0.8187308 * (-0.5 - 1.2 - 1.1)) / 5, rel=1e-6)
    # GMPO, 0.15 in log space: row 0 A > 0 caps 0.3 at 0.15 -> e^((0.15 - 0.05)/2); row 1 A < 0 floors -0.2 at -0.15
    assert seq_mean(ref_gmpo(0.15, 0.15)) == pytest.approx((-0.5 * math.exp(0.05) + math.exp(-0.15)) / 2)


@pytest.mark.parametrize("agg, reduce", [("seq-mean-token-mean", seq_mean), ("token-mean", token_mean)])
@pytest.mark.parametrize("cl, ch", [(0.2, 0.2), (0.1, 0.1), (3e-4, 4e-4)])
def test_gspo_matches_the_paper(agg, reduce, cl, ch):
    loss, metrics = _call(gspo_loss, agg, clip_low=cl, clip_high=ch)
    assert loss.item() == pytest.approx(reduce(ref_gspo(cl, ch)), rel=1e-12)
    assert metrics["seq_ratio_mean"].item() == pytest.approx((math.exp(0.125) + math.exp(-0.2)) / 2, rel=1e-12)


def test_gspo_token_uses_each_tokens_advantage():
    adv = [[0.5, 1.5, 9.0], [-1.0, -0.2, 0.4]]
    for fn, token_adv in ((gspo_token_loss, True), (gspo_loss, False)):
        loss, _ = fn(_t(LOGP), _t(OLD), _t(adv), _t(MASK).bool(), clip_low=0.1, clip_high=0.1, agg="token-mean")
        assert loss.item() == pytest.approx(token_mean(ref_gspo(0.1, 0.1, adv, token_adv)), rel=1e-12)
    # with one advantage per sequence the two are the same loss
    assert _call(gspo_token_loss, "token-mean")[0].item() == pytest.approx(_call(gspo_loss, "token-mean")[0].item())


@pytest.mark.parametrize("agg, reduce", [("token-mean", token_mean), ("seq-mean-token-mean", seq_mean)])
@pytest.mark.parametrize("cl, ch", [(0.2, 0.1), (0.1, 4.0)])
def test_cispo_matches_the_paper(agg, reduce, cl, ch):
    loss, metrics = _call(cispo_loss, agg, clip_low=cl, clip_high=ch)
    assert loss.item() == pytest.approx(reduce(ref_cispo(cl, ch)), rel=1e-12)
    ratios = [math.exp(0.3), math.exp(-0.05)] + [math.exp(-0.2)] * 3
    assert metrics["clip_frac"].item() == pytest.approx(sum(not 1 - cl <= r <= 1 + ch for r in ratios) / 5)


@pytest.mark.parametrize("agg, reduce", [("seq-mean-token-mean", seq_mean), ("token-mean", token_mean)])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_the_paper(agg, reduce, tau_pos, tau_neg):
    loss, _ = _call(sapo_loss, agg, tau_pos=tau_pos, tau_neg=tau_neg)
    assert loss.item() == pytest.approx(reduce(ref_sapo(tau_pos, tau_neg)), rel=1e-12)


@pytest.mark.parametrize("agg, reduce", [("seq-mean-token-mean", seq_mean), ("token-mean", token_mean)])
@pytest.mark.parametrize("cl, ch", [(0.4, 0.4), (0.15, 0.15), (0.1, 0.25)])
def test_gmpo_matches_the_paper(agg, reduce, cl, ch):
    loss, metrics = _call(gmpo_loss, agg, clip_low=cl, clip_high=ch)
    assert loss.item() == pytest.approx(reduce(ref_gmpo(cl, ch)), rel=1e-12)
    clipped = (ch < 0.3) + 3 * (cl < 0.2)  # row 0 (A > 0) caps above, row 1 (A < 0) floors below
    assert metrics["clip_frac"].item() == pytest.approx(clipped / 5)


# ---- gradients -------------------------------------------------------------------------------------------------
def test_gspo_gradient_is_the_sequence_ratio_gradient():
    """d/dlogp_t of (1/G) sum_i l_i: -A_i s_i / (G |y_i|) at each token of an unclipped sequence, 0 when clipped."""
    logp = _t(LOGP, grad=True)
    gspo_loss(logp, _t(OLD), _t(ADV), _t(MASK).bool(), clip_low=0.2, clip_high=0.1,
              agg="seq-mean-token-mean")[0].backward()
    s0 = math.exp(0.125)  # > 1.1 with A > 0: clipped, no gradient; row 1: s = 0.8187 in range
    assert s0 > 1.1
    expected = [[0.0, 0.0, 0.0], [1.0 * math.exp(-0.2) / (2 * 3)] * 3]
    assert torch.allclose(logp.grad, _t(expected), rtol=1e-12, atol=1e-15)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """d/dlogp_t = -w_t A_t / N: the token whose ratio e^0.3 left the range still moves, weighted by the cap."""
    logp = _t(LOGP, grad=True)
    cispo_loss(logp, _t(OLD), _t(ADV), _t(MASK).bool(), clip_low=0.2, clip_high=0.1, agg="token-mean")[0].backward()
    expected = [[-1.1 * 0.5 / 5, -math.exp(-0.05) * 0.5 / 5, 0.0], [math.exp(-0.2) / 5] * 3]
    assert torch.allclose(logp.grad, _t(expected), rtol=1e-12, atol=1e-15)
    ppo = _t(LOGP, grad=True)
    policy_loss(ppo, _t(OLD), _t(ADV), _t(MASK).bool(), clip_low=0.2, clip_high=0.1)[0].backward()
    assert ppo.grad[0, 0].item() == 0.0  # where PPO drops it


def test_sapo_gradient_is_the_policy_gradient_on_policy():
    """At r = 1 the gate's slope is 1: the gradient is -A / N, as the unclipped policy gradient's."""
    logp = _t(LOGP, grad=True)
    sapo_loss(logp, logp.detach(), _t(ADV), _t(MASK).bool(), agg="token-mean")[0].backward()
    assert torch.allclose(logp.grad, -_t(ADV) * _t(MASK) / 5, rtol=1e-12, atol=1e-15)


# Stop-gradient constructions are not the derivative of their value: CISPO's detached weight (its gradient is tested
# in closed form above) and GSPO's token form under per-token IS weights. The others are checked by finite
# differences: GSPO with one advantage per sequence and no IS weights is the derivative of (1/G) sum_i l_i.
GRADCHECK = {"gspo": False, "gspo-token": False, "sapo": True, "gmpo": True}


@pytest.mark.parametrize("name", ["gspo", "gspo-token", "cispo", "sapo", "gmpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradients_flow_and_match_finite_differences(make_masks, name, agg):
    mask = make_masks(4, 5, seed=7)["gaps"]
    gen = torch.Generator().manual_seed(8)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    logp = (old + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.05).requires_grad_()
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 5)
    is_w = torch.rand(4, 5, generator=gen, dtype=torch.float64) + 0.5
    fn = POLICY_LOSSES.get(name).fn
    loss, _ = fn(logp, old, adv, mask, clip_low=0.3, clip_high=0.3, agg=agg, is_weights=is_w)
    loss.backward()
    assert (logp.grad[mask] != 0).all() and (logp.grad[~mask] == 0).all()
    if name in GRADCHECK:
        kw = dict(clip_low=0.3, clip_high=0.3, agg=agg, is_weights=is_w if GRADCHECK[name] else None)
        assert gradcheck(lambda lp: fn(lp, old, adv, mask, **kw)[0], (logp.detach().requires_grad_(),))


# ---- masking, registry, config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gspo", "gspo-token", "cispo", "sapo", "gmpo"])
def test_masked_tokens_have_no_effect(name):
    fn = POLICY_LOSSES.get(name).fn
    mask = _t(MASK).bool()
    clean = _t(LOGP, grad=True)
    loss, metrics = fn(clean, _t(OLD), _t(ADV), mask, agg="token-mean")
    loss.backward()
    wild = [row[:] for row in LOGP]
    wild_old, wild_adv = [row[:] for row in OLD], [row[:] for row in ADV]
    wild[0][2], wild_old[0][2], wild_adv[0][2] = 25.0, -40.0, -300.0  # the padding position of row 0
    poisoned = _t(wild, grad=True)
    loss2, metrics2 = fn(poisoned, _t(wild_old), _t(wild_adv), mask, agg="token-mean")
    loss2.backward()
    assert loss2.item() == loss.item()
    assert {k: v.item() for k, v in metrics2.items()} == {k: v.item() for k, v in metrics.items()}
    assert poisoned.grad[0, 2].item() == 0.0 and torch.equal(poisoned.grad[mask], clean.grad[mask])


def test_new_losses_are_choices_with_help_and_refuse_dual_clip():
    text = help_text()
    for name in ("gspo", "gspo-token", "cispo", "sapo", "gmpo"):
        assert parse_config(["--rl.policy_loss", name]).rl.policy_loss == name
        assert f"      {name}: " in text
    cfg = parse_config(["--rl.policy_loss", "sapo", "--rl.sapo_tau_pos", "0.7", "--rl.sapo_tau_neg", "2"])
    assert (cfg.rl.sapo_tau_pos, cfg.rl.sapo_tau_neg) == (0.7, 2.0)
    with pytest.raises(ConfigError, match="rl.dual_clip=3.0 is a PPO-loss setting.*rl.policy_loss=gspo"):
        parse_config(["--rl.policy_loss", "gspo", "--rl.dual_clip", "3"])
    with pytest.raises(ValueError, match="dual_clip"):
        _call(cispo_loss, "token-mean", dual_clip=3.0)


def test_a_policy_loss_given_as_the_algorithm_names_the_setting_it_belongs_to():
    hint = r"\('gspo' is a choice of --rl.policy_loss\)$"
    with pytest.raises(ConfigError, match=r"^rl.algo='gspo': choose one of .*" + hint):
        parse_config(["--rl.algo", "gspo"])
