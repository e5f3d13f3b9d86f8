"""Advantage estimators against slow Python-float references, on ragged padded and packed layouts."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from ds_rlhf.algos import (
    broadcast_to_tokens,
    broadcast_to_tokens_packed,
    compute_advantages,
    gae,
    gae_packed,
    group_advantages,
    masked_whiten,
    packed_to_padded,
    padded_to_packed,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    token_rewards_from_scores,
)

B, T = 6, 9


def _valid_idx(mask_row: list[bool]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m]


def ref_gae(rewards, values, mask, gamma, lam):
    """Row by row, over the list of valid positions, in Python floats."""
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for i, row in enumerate(mask):
        next_v, next_a = 0.0, 0.0
        for t in reversed(_valid_idx(row)):
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            next_a = delta + gamma * lam * next_a
            next_v = values[i][t]
            adv[i][t], ret[i][t] = next_a, next_a + values[i][t]
    return adv, ret


def ref_returns(rewards, mask, gamma):
    out = [[0.0] * len(r) for r in rewards]
    for i, row in enumerate(mask):
        g = 0.0
        for t in reversed(_valid_idx(row)):
            g = rewards[i][t] + gamma * g
            out[i][t] = g
    return out


def ref_whiten(x, mask, eps=1e-8):
    vals = [x[i][t] for i, row in enumerate(mask) for t in _valid_idx(row)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(x[i][t] - mean) / math.sqrt(var + eps) if m else 0.0 for t, m in enumerate(row)]
            for i, row in enumerate(mask)]


def _close(actual, expected, atol=1e-10):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-9)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("kind", ["right", "left", "gaps"])
def test_gae_matches_reference(make_masks, kind, gamma, lam):
    mask = make_masks(B, T, seed=1)[kind]
    rewards, values = _rand(B, T, seed=2), _rand(B, T, seed=3)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    _close(adv, ref_adv)
    _close(ret, ref_ret)


def test_gae_gamma_lambda_one_is_return_minus_value(make_masks):
    mask = make_masks(B, T, seed=4)["gaps"]
    rewards, values = _rand(B, T, seed=5), _rand(B, T, seed=6)
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    for i in range(B):
        idx = _valid_idx(mask[i].tolist())
        for k, t in enumerate(idx):
            expected = sum(rewards[i, s].item() for s in idx[k:]) - values[i, t].item()
            assert abs(adv[i, t].item() - expected) < 1e-10


def test_gae_lambda_zero_is_one_step_td_error(make_masks):
    mask = make_masks(B, T, seed=7)["right"]
    rewards, values = _rand(B, T, seed=8), _rand(B, T, seed=9)
    adv, _ = gae(rewards, values, mask, 0.9, 0.0)
    for i in range(B):
        idx = _valid_idx(mask[i].tolist())
        for k, t in enumerate(idx):
            next_v = values[i, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            assert abs(adv[i, t].item() - (rewards[i, t].item() + 0.9 * next_v - values[i, t].item())) < 1e-12


def test_gae_ignores_whatever_sits_in_masked_positions(make_masks):
    mask = make_masks(B, T, seed=10)["gaps"]
    rewards, values = _rand(B, T, seed=11), _rand(B, T, seed=12)
    adv, ret = gae(rewards, values, mask, 0.97, 0.9)
    poisoned_r = torch.where(mask, rewards, float("nan"))
    poisoned_v = torch.where(mask, values, 1e6)
    adv2, ret2 = gae(poisoned_r, poisoned_v, mask, 0.97, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_float32_inputs_close_to_float64(make_masks):
    mask = make_masks(B, T, seed=13)["right"]
    rewards, values = _rand(B, T, seed=14), _rand(B, T, seed=15)
    adv32, _ = gae(rewards.float(), values.float(), mask, 0.99, 0.95)
    adv64, _ = gae(rewards, values, mask, 0.99, 0.95)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv64, atol=1e-5, rtol=1e-5)


def _packed_case(seed=20):
    lengths = [3, 0, 5, 1, 7, 2]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    n = int(cu[-1])
    return lengths, cu, _rand(n, seed=seed), _rand(n, seed=seed + 1)


def test_packing_round_trip_and_layout():
    lengths, cu, x, _ = _packed_case()
    padded, valid = packed_to_padded(x, cu)
    assert padded.shape == (len(lengths), max(lengths))
    assert valid.sum(1).tolist() == lengths
    flat = x.tolist()
    for i, n in enumerate(lengths):
        assert padded[i, :n].tolist() == flat[int(cu[i]):int(cu[i]) + n]
    assert torch.equal(padded_to_packed(padded, cu), x)
    with pytest.raises(ValueError):
        packed_to_padded(x, torch.tensor([0, 3, 2, x.numel()]))


@pytest.mark.parametrize("with_loss_mask", [False, True])
def test_gae_packed_equals_reference_and_padded(with_loss_mask):
    lengths, cu, rewards, values = _packed_case()
    loss_mask = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(3)) < 0.7 if with_loss_mask else None
    adv, ret = gae_packed(rewards, values, cu, 0.95, 0.9, mask=loss_mask)
    assert adv.shape == rewards.shape
    # reference: each packed segment on its own, in Python floats
    lm = loss_mask.tolist() if with_loss_mask else [True] * rewards.numel()
    for i in range(len(lengths)):
        s, e = int(cu[i]), int(cu[i + 1])
        ref_adv, ref_ret = ref_gae([rewards[s:e].tolist()], [values[s:e].tolist()], [lm[s:e]], 0.95, 0.9)
        _close(adv[s:e], ref_adv[0])
        _close(ret[s:e], ref_ret[0])
    # padded layout gives the same numbers
    r_pad, valid = packed_to_padded(rewards, cu)
    v_pad, _ = packed_to_padded(values, cu)
    if with_loss_mask:
        valid = valid & packed_to_padded(loss_mask, cu)[0]
    adv_pad, ret_pad = gae(r_pad, v_pad, valid, 0.95, 0.9)
    assert torch.equal(padded_to_packed(adv_pad, cu), adv)
    assert torch.equal(padded_to_packed(ret_pad, cu), ret)


def ref_group(scores, g, mode, eps=1e-6):
    out = []
    for k in range(0, len(scores), g):
        grp = scores[k:k + g]
        mean = sum(grp) / g
        for j, s in enumerate(grp):
            if mode == "grpo":
                out.append((s - mean) / (statistics.stdev(grp) + eps))
            elif mode == "grpo_no_std":
                out.append(s - mean)
            else:
                out.append(s - sum(grp[:j] + grp[j + 1:]) / (g - 1))
    return out


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "rloo"])
@pytest.mark.parametrize("group_size", [2, 4])
def test_group_advantages_match_reference_and_have_zero_group_mean(mode, group_size):
    scores = _rand(12, seed=30)
    adv = group_advantages(scores, group_size, mode)
    _close(adv, ref_group(scores.tolist(), group_size, mode), atol=1e-9)
    assert adv.view(-1, group_size).mean(1).abs().max() < 1e-12
    if mode == "grpo":
        torch.testing.assert_close(adv.view(-1, group_size).std(1), torch.ones(12 // group_size, dtype=torch.float64),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "rloo"])
def test_group_advantages_with_ragged_group_ids(mode):
    """Groups that lost samples: ids in any order, sizes 3, 1, 4, 2; the lone sample gets 0."""
    ids = torch.tensor([7, 2, 7, 5, 2, 2, 9, 7, 2, 9])
    scores = _rand(10, seed=34)
    adv = group_advantages(scores, mode=mode, group_ids=ids)
    expected = [0.0] * 10
    for gid in set(ids.tolist()):
        idx = [i for i, g in enumerate(ids.tolist()) if g == gid]
        if len(idx) > 1:
            for i, a in zip(idx, ref_group([scores[i].item() for i in idx], len(idx), mode)):
                expected[i] = a
    _close(adv, expected, atol=1e-9)
    contiguous = group_advantages(scores[:8], 4, mode)
    torch.testing.assert_close(group_advantages(scores[:8], mode=mode, group_ids=torch.arange(8) // 4), contiguous)


def test_group_advantages_edge_cases():
    flat = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv = group_advantages(flat, 3, "grpo")
    assert torch.isfinite(adv).all() and (adv[:3] == 0).all()
    assert (group_advantages(torch.randn(5), 1, "rloo") == 0).all()
    with pytest.raises(ValueError):
        group_advantages(torch.randn(5), 2, "grpo")
    with pytest.raises(ValueError):
        group_advantages(torch.randn(4), 2, "ppo")


def test_broadcast_to_tokens_padded_and_packed(make_masks):
    mask = make_masks(B, T, seed=31)["gaps"]
    seq_adv = _rand(B, seed=32)
    tok = broadcast_to_tokens(seq_adv, mask)
    for i in range(B):
        for t in range(T):
            assert tok[i, t].item() == (seq_adv[i].item() if mask[i, t] else 0.0)
    lengths, cu, _, _ = _packed_case()
    seq_adv = _rand(len(lengths), seed=33)
    packed = broadcast_to_tokens_packed(seq_adv, cu)
    assert packed.tolist() == [seq_adv[i].item() for i, n in enumerate(lengths) for _ in range(n)]


def test_token_rewards_from_scores(make_masks):
    mask = make_masks(B, T, seed=34)["gaps"]
    scores, kl = _rand(B, seed=35), _rand(B, T, seed=36).abs()
    rewards = token_rewards_from_scores(scores, mask, kl=kl, kl_coef=0.1)
    for i in range(B):
        idx = _valid_idx(mask[i].tolist())
        for t in range(T):
            expected = -0.1 * kl[i, t].item() if t in idx else 0.0
            if idx and t == idx[-1]:
                expected += scores[i].item()
            assert abs(rewards[i, t].item() - expected) < 1e-12


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_returns_match_reference(make_masks, gamma):
    mask = make_masks(B, T, seed=40)["gaps"]
    rewards = _rand(B, T, seed=41)
    _close(reinforce_pp_returns(rewards, mask, gamma), ref_returns(rewards.tolist(), mask.tolist(), gamma))


def test_masked_whiten_matches_reference_and_normalises(make_masks):
    mask = make_masks(B, T, seed=42)["left"]
    x = _rand(B, T, seed=43) * 3 + 2
    out = masked_whiten(x, mask)
    _close(out, ref_whiten(x.tolist(), mask.tolist()), atol=1e-9)
    vals = out[mask]
    assert abs(vals.mean().item()) < 1e-12 and abs(vals.std().item() - 1) < 1e-6
    kept = masked_whiten(x, mask, shift_mean=False)
    assert abs(kept[mask].mean().item() - x[mask].mean().item()) < 1e-9
    given = masked_whiten(x, mask, mean=1.0, var=4.0, eps=0.0)
    torch.testing.assert_close(given[mask], (x[mask] - 1.0) / 2.0)


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_reinforce_pp_advantages_match_reference(make_masks, gamma):
    mask = make_masks(B, T, seed=44)["right"]
    rewards = _rand(B, T, seed=45)
    adv = reinforce_pp_advantages(rewards, mask, gamma)
    _close(adv, ref_whiten(ref_returns(rewards.tolist(), mask.tolist(), gamma), mask.tolist()), atol=1e-9)


@pytest.mark.parametrize("explicit_baseline", [False, True])
def test_reinforce_pp_baseline_matches_reference(explicit_baseline):
    group_size, batch = 3, 6
    mask = torch.arange(T) < torch.tensor([9, 4, 6, 2, 9, 5])[:, None]
    rewards = _rand(batch, T, seed=46)
    scores = _rand(batch, seed=47)
    adv = reinforce_pp_advantages(rewards, mask, 0.9, baseline_scores=scores if explicit_baseline else None,
                                  group_size=group_size)
    rets = ref_returns(rewards.tolist(), mask.tolist(), 0.9)
    base = scores.tolist() if explicit_baseline else [rets[i][0] for i in range(batch)]
    shifted = [[rets[i][t] - sum(base[i // group_size * group_size:][:group_size]) / group_size for t in range(T)]
               for i in range(batch)]
    _close(adv, ref_whiten(shifted, mask.tolist()), atol=1e-9)


def test_reinforce_pp_baseline_with_ragged_group_ids():
    mask = torch.arange(T) < torch.tensor([9, 4, 6, 2, 9])[:, None]
    rewards, scores, ids = _rand(5, T, seed=48), _rand(5, seed=49), torch.tensor([1, 0, 1, 1, 0])
    adv = reinforce_pp_advantages(rewards, mask, 1.0, baseline_scores=scores, group_ids=ids)
    rets = ref_returns(rewards.tolist(), mask.tolist(), 1.0)
    s = scores.tolist()
    base = {g: sum(s[i] for i in range(5) if ids[i] == g) / int((ids == g).sum()) for g in (0, 1)}
    shifted = [[rets[i][t] - base[int(ids[i])] for t in range(T)] for i in range(5)]
    _close(adv, ref_whiten(shifted, mask.tolist()), atol=1e-9)
    via_dispatch, _ = compute_advantages("reinforce_pp_baseline", token_rewards=rewards, mask=mask, gamma=1.0,
                                         baseline_scores=scores, group_ids=ids)
    torch.testing.assert_close(via_dispatch, adv)


def _algo_inputs(algo, batch, length, mask, seed):
    token = _rand(batch, length, seed=seed)
    if algo == "ppo":
        return dict(rewards=token, values=_rand(batch, length, seed=seed + 1), gamma=0.99, lam=0.9)
    if algo in ("grpo", "dr_grpo", "rloo"):
        return dict(scores=_rand(batch, seed=seed + 2), group_size=2)
    if algo == "reinforce_pp":
        return dict(token_rewards=token, gamma=0.95)
    return dict(token_rewards=token, gamma=1.0, group_size=2)


@pytest.mark.parametrize("algo", ["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_compute_advantages_dispatch_and_packed_equals_padded(make_masks, algo):
    mask = make_masks(B, T, seed=50)["right"]
    inputs = _algo_inputs(algo, B, T, mask, seed=51)
    adv, ret = compute_advantages(algo, mask=mask, **inputs)
    if algo == "ppo":
        g_adv, g_ret = gae(inputs["rewards"], inputs["values"], mask, 0.99, 0.9)
        _close(adv, ref_whiten(g_adv.tolist(), mask.tolist()), atol=1e-9)
        assert torch.equal(ret, g_ret)
    elif algo in ("grpo", "dr_grpo", "rloo"):
        mode = {"grpo": "grpo", "dr_grpo": "grpo_no_std", "rloo": "rloo"}[algo]
        seq = ref_group(inputs["scores"].tolist(), 2, mode)
        _close(adv, [[seq[i] if m else 0.0 for m in row] for i, row in enumerate(mask.tolist())], atol=1e-9)
        assert ret is None
    # packed: the same sequences laid end to end
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed = {k: (v[mask] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in inputs.items()}
    adv_p, ret_p = compute_advantages(algo, cu_seqlens=cu, **packed)
    torch.testing.assert_close(adv_p, adv[mask], atol=1e-12, rtol=0)
    if ret is not None:
        torch.testing.assert_close(ret_p, ret[mask], atol=1e-12, rtol=0)


def test_compute_advantages_rejects_unknown_inputs():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError):
        compute_advantages("grpo", scores=torch.randn(2), group_size=2, mask=mask, gama=1.0)
    with pytest.raises(ValueError):
        compute_advantages("a2c", mask=mask)


def test_grpo_scale_rewards_batch_keeps_a_format_only_group_small():
    """`rl.scale_rewards batch`: a group whose only signal is a 0.1 format credit gets advantages a tenth of a
    correct-vs-wrong group's; with the per-group std (`group`) the lone formatted guess outweighs a right answer."""
    scores = torch.tensor([0.1, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    mask, ids = torch.ones(8, 3), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    per_group, _ = compute_advantages("grpo", scores=scores, mask=mask, group_ids=ids, scale_rewards="group")
    per_batch, _ = compute_advantages("grpo", scores=scores, mask=mask, group_ids=ids, scale_rewards="batch")
    none, _ = compute_advantages("grpo", scores=scores, mask=mask, group_ids=ids, scale_rewards="none")
    assert per_group[0, 0] > per_group[4, 0]
    centred = scores - torch.tensor([0.025] * 4 + [0.5] * 4)
    torch.testing.assert_close(per_batch[:, 0], centred / (scores.std() + 1e-6))
    torch.testing.assert_close(none[:, 0], centred)
    assert per_batch[0, 0] < 0.2 * per_batch[4, 0]
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages("grpo", scores=scores, mask=mask, group_ids=ids, scale_rewards="global")
