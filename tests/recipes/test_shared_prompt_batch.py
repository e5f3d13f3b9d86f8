"""The shared-prompt layout of RL micro-batches (`data.rl_shared_prompt`): each group's prompt forwarded once gives
the padded rows' log-probs, entropy, gradients and updates (fp32 tiny model, CPU), and micro-batches hold whole
groups."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import Config, ConfigError
from ds_rlhf.engines.models import GC_KWARGS
from ds_rlhf.recipes import policy_update as policy_update_module
from ds_rlhf.recipes.policy_update import (
    actor_micro_step,
    forward_logprobs,
    micro_batches,
    micro_logprobs,
    mini_batch_rows,
    policy_update,
    shared_prompt,
)
from ds_rlhf.recipes.rl_build import resolve_shared_prompt
from ds_rlhf.recipes.shared_prompt_batch import group_micro_batches, group_mini_batches, group_order, share_prompts
from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
from ds_rlhf.rollout.base import RolloutSample
from tests.recipes import policy_fixtures
from tests.recipes.policy_fixtures import as_engine

actor, one_thread = policy_fixtures.actor, policy_fixtures.one_thread  # the module's fixtures

PROMPTS = [5, 9, 2, 7, 3]  # prompt lengths of the groups: ragged, so the prompt pass pads too


def _traj(n: int, seed: int = 0, prompts=PROMPTS, max_response: int = 9):
    """Groups of `n` samples sharing their prompt, responses of 1 .. max_response - 1 tokens, right-padded rows."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g, p in enumerate(prompts):
        prompt = torch.randint(10, 400, (p,), generator=gen).tolist()
        for k in range(n):
            r = int(torch.randint(1, max_response, (1,), generator=gen))
            samples.append(RolloutSample(prompt_index=g, sample_index=k, prompt_ids=prompt,
                                         response_ids=torch.randint(10, 400, (r,), generator=gen).tolist(),
                                         logprobs=(-4.0 + torch.rand(r, generator=gen)).tolist(),
                                         finish_reason="stop"))
    cfg = Config()
    traj = pad_trajectory(samples, torch.rand(len(samples), generator=gen).tolist(), pad_id=0)
    traj = with_advantages(traj, cfg.rl, 0.0)
    return traj.replace(ref_logp=traj.rollout_logp + 0.1 * traj.action_mask)


def _cfg(mode: str, budget: int = 0, micro_rows: int = 4, **rollout) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, rl_shared_prompt=mode, micro_batch_tokens=budget),
        optim=dataclasses.replace(cfg.optim, micro_batch_size=micro_rows),
        rollout=dataclasses.replace(cfg.rollout, **rollout), rl=dataclasses.replace(cfg.rl, entropy_coef=0.01))


def test_layout_forwards_each_prompt_once_and_maps_back_to_the_padded_rows():
    traj = _traj(8)
    layout = share_prompts(traj.input_ids, traj.prompt_lens, traj.response_lens, traj.group_ids)
    assert layout.prompt_ids.shape == (len(PROMPTS), max(PROMPTS))
    assert layout.prompt_lens.tolist() == PROMPTS
    for i in range(len(traj)):
        p, r, g = int(traj.prompt_lens[i]), int(traj.response_lens[i]), int(layout.group_index[i])
        assert layout.prompt_ids[g, :p].tolist() == traj.input_ids[i, :p].tolist()
        assert layout.response_ids[i, :r].tolist() == traj.input_ids[i, p:p + r].tolist()
        assert layout.response_positions[i, :r].tolist() == list(range(p, p + r))
    # the layout's targets, gathered back, are the padded rows' response targets, and nothing else is read
    back = layout.unpack(layout.response_ids)
    acting = traj.action_mask > 0
    assert torch.equal(back[acting], traj.input_ids[:, 1:][acting]) and (back[~acting] == 0).all()
    assert int(layout.shared_mask(traj.action_mask).sum()) == int(acting.sum())
    assert layout.forward_tokens < traj.input_ids.numel()


def test_rows_of_one_group_with_different_prompts_get_their_own_prompt_rows():
    traj = _traj(2, prompts=[4, 4])
    ids = traj.input_ids.clone()
    ids[1, 2] += 1  # row 1 claims group 0 but its prompt differs from row 0's
    layout = share_prompts(ids, traj.prompt_lens, traj.response_lens, traj.group_ids)
    assert layout.group_index.tolist() == [0, 1, 2, 2]
    assert layout.prompt_ids[1].tolist() == ids[1, :4].tolist()


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logprobs_and_entropy_match_the_padded_rows(actor, n, attn):
    traj = _traj(n)
    actor.config._attn_implementation = attn
    try:
        with torch.no_grad():
            padded = micro_logprobs(actor, traj, _cfg("off"), with_entropy=True)
            shared = micro_logprobs(actor, traj, _cfg("on"), with_entropy=True)
            truncated = [micro_logprobs(actor, traj, _cfg(mode, temperature=0.7, top_k=20), with_entropy=True)
                         for mode in ("off", "on")]
    finally:
        actor.config._attn_implementation = "sdpa"
    acting = traj.action_mask > 0
    for a, b in (*zip(padded, shared), *zip(*truncated)):
        assert a.shape == b.shape == traj.action_mask.shape
        assert (a - b).abs().max() < 1e-5, (a - b).abs().max()
        assert (b[~acting] == 0).all() and (b[acting] != 0).any()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_loss_gradients_match_the_padded_rows(actor, checkpointing):
    traj = _traj(8)
    grads, results = [], []
    for mode in ("off", "on"):
        model = as_engine(copy.deepcopy(actor))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GC_KWARGS)
        model.train()
        metrics, logp = actor_micro_step(model, traj, _cfg(mode), kl_coef=0.05, share=0.5)
        grads.append({name: p.grad for name, p in model.named_parameters()})
        results.append((metrics, logp))
    assert grads[0]["model.embed_tokens.weight"].abs().sum() > 0
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-4), name
    (m0, logp0), (m1, logp1) = results
    for key in m0:
        assert float(m0[key]) == pytest.approx(float(m1[key]), abs=1e-5), key
    assert (logp0 - logp1).abs().max() < 1e-5


@pytest.mark.parametrize("rl", [dict(), dict(algo="grpo", ppo_epochs=2, mini_batch_size=16)],
                         ids=["single-update", "two-epochs"])
def test_policy_update_matches_the_padded_rows(actor, rl, monkeypatch):
    """The padded rows run on the shared layout's mini-batches (whole groups), so the two updates see the same
    mini-batch composition and must agree."""
    results, seen = [], {"off": [], "on": []}
    mode = "off"

    def same_mini_batches(exp, count, generator, *, shuffle, grouped):
        rows = mini_batch_rows(exp, count, generator, shuffle=shuffle, grouped=True)
        seen[mode].append(rows)
        return rows

    monkeypatch.setattr(policy_update_module, "mini_batch_rows", same_mini_batches)
    for mode in ("off", "on"):
        cfg = _cfg(mode, budget=160)
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, **rl))
        model = as_engine(copy.deepcopy(actor))
        traj = _traj(8)
        if rl:
            traj = traj.replace(old_logp=forward_logprobs(model, traj, cfg))
        result = policy_update(model, None, traj, cfg, kl_coef=0.05, generator=torch.Generator().manual_seed(3))
        results.append((result, dict(model.named_parameters()), traj))
    (r0, p0, t0), (r1, p1, t1) = results
    assert seen["off"] == seen["on"] and len(seen["on"]) == (2 if rl else 1)  # one call per epoch
    assert all(set(_pieces(epoch, t1.group_ids.tolist()).values()) == {1} for epoch in seen["on"])
    if rl:
        assert (t0.old_logp - t1.old_logp).abs().max() < 1e-5
    assert (r0.trainer_logp - r1.trainer_logp).abs().max() < 1e-5
    for name, p in p0.items():
        assert torch.allclose(p, p1[name], atol=1e-6), name
    assert r0.metrics.keys() == r1.metrics.keys()
    assert r0.metrics["actor/loss"] == pytest.approx(r1.metrics["actor/loss"], abs=1e-5)


def _cost(rows, p, r, groups) -> int:
    shared = len({groups[i] for i in rows}) * max(p[i] for i in rows) + len(rows) * max(r[i] for i in rows)
    return max(shared, len(rows) * max(p[i] + r[i] for i in rows))


@pytest.mark.parametrize("budget, rows", [(150, 4), (60, 4), (0, 8), (0, 3)])
def test_micro_batches_hold_whole_groups(budget, rows):
    traj = _traj(4, max_response=30)
    everything = list(range(len(traj)))
    micro = micro_batches(traj, everything, max_tokens=budget, max_rows=rows, shared=True)
    assert sorted(i for m in micro for i in m) == everything
    groups = traj.group_ids.tolist()
    p, r = traj.prompt_lens.tolist(), traj.response_lens.tolist()
    for m in micro:
        assert len(m) == 1 or (_cost(m, p, r, groups) <= budget if budget else len(m) <= rows)
    split = 0
    for g in set(groups):
        members = [i for i in everything if groups[i] == g]
        fits = _cost(members, p, r, groups) <= budget if budget else len(members) <= rows
        pieces = sum(1 for m in micro if set(m) & set(members))
        assert (pieces == 1) == fits, (g, pieces, fits)  # split only where the group alone is over the limit
        split += pieces > 1
    # both cases occur: 150 tokens hold some groups whole and not others; 3 rows hold none of the 4-row groups
    assert split in {(150, 4): range(1, 5), (60, 4): [5], (0, 8): [0], (0, 3): [5]}[budget, rows], split


def test_a_rank_with_fewer_micro_batches_splits_its_largest_then_adds_empty_ones(monkeypatch):
    from ds_rlhf.recipes import shared_prompt_batch

    monkeypatch.setattr(shared_prompt_batch, "agree_max", lambda count, device: 5)
    got = group_micro_batches([3, 3, 3, 4], [2, 2, 2, 2], [0, 0, 0, 1], [0, 1, 2, 3], max_tokens=0, max_rows=8)
    assert got == [[3], [0], [1], [2], []], got  # one micro-batch [3, 0, 1, 2] (longest group first), halved


def test_auto_turns_on_for_groups_whose_prompt_is_worth_sharing():
    assert shared_prompt(_cfg("auto", n_samples=8))
    assert not shared_prompt(_cfg("auto", n_samples=1))
    assert not shared_prompt(_cfg("auto", n_samples=8, max_new_tokens=8192))  # the prompt is under 5% of a row
    assert not shared_prompt(dataclasses.replace(_cfg("auto", 64), data=dataclasses.replace(
        _cfg("auto", 64).data, rl_packing=True)))
    assert shared_prompt(_cfg("on", n_samples=1)) and not shared_prompt(_cfg("off", n_samples=8))
    with pytest.raises(ConfigError, match="choose one"):
        dataclasses.replace(_cfg("on", 64).data, rl_packing=True).check()


def test_the_build_resolves_the_setting_once_and_says_which_layout(actor):
    printed = []

    def resolve(mode: str, kernel: str = "sdpa") -> str:
        ctx = SimpleNamespace(cfg=_cfg(mode, n_samples=8), print=printed.append)
        actor.config._attn_implementation = kernel
        try:
            resolve_shared_prompt(ctx, actor)
        finally:
            actor.config._attn_implementation = "sdpa"
        return ctx.cfg.data.rl_shared_prompt

    assert resolve("auto") == "on" and "shared prompt" in printed[-1]
    assert resolve("off") == "off" and printed[-1] == "[rl] log-prob passes: padded rows (data.rl_shared_prompt off)"
    assert resolve("auto", "torch_varlen") == "off" and "reads no KV cache" in printed[-1]
    with pytest.raises(ConfigError, match="rl_shared_prompt=on"):
        resolve("on", "torch_varlen")


def _pieces(mini: list[list[int]], groups: list[int]) -> dict[int, int]:
    """For each group, the mini-batches holding some of its rows."""
    return {g: sum(any(groups[i] == g for i in m) for m in mini) for g in set(groups)}


@pytest.mark.parametrize("sizes, mini, expected", [
    ([8] * 5, 16, [16, 16, 8]),  # cuts at 14 and 28 move to the group boundaries 16 and 32 (a tie: after)
    ([8] * 5, 8, [8] * 5),
    ([8, 5, 8, 3, 8], 12, [13, 8, 11]),  # groups that lost samples: cuts at 11 and 22 -> 13 and 21
])
def test_mini_batches_hold_whole_groups_of_the_users_size(sizes, mini, expected):
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    rows = group_mini_batches(groups, list(range(len(groups))), -(-len(groups) // mini))
    assert [len(m) for m in rows] == expected
    assert set(_pieces(rows, groups).values()) == {1}, rows
    shuffled = group_order(groups, torch.Generator().manual_seed(1))
    assert sorted(shuffled) == list(range(len(groups))) and shuffled != list(range(len(groups)))
    starts = [k for k in range(len(groups)) if k == 0 or groups[shuffled[k]] != groups[shuffled[k - 1]]]
    assert len(starts) == len(sizes)  # each group's rows together


def test_mini_batches_smaller_than_a_group_cut_it_where_they_fall():
    groups = [g for g in range(4) for _ in range(8)]
    rows = group_mini_batches(groups, group_order(groups, torch.Generator().manual_seed(1)), 8)
    assert [len(m) for m in rows] == [4] * 8
    assert set(_pieces(rows, groups).values()) == {2}  # each group in two consecutive mini-batches, no more


def _forward_tokens(traj, mini: list[list[int]], budget: int) -> int:
    total = 0
    for rows in mini:
        for micro in micro_batches(traj, rows, max_tokens=budget, max_rows=0, shared=True):
            mb = traj.select(micro)
            total += share_prompts(mb.input_ids, mb.prompt_lens, mb.response_lens, mb.group_ids).forward_tokens
    return total


def test_group_shuffling_forwards_fewer_tokens_than_row_wise_shuffling():
    traj = _traj(8, prompts=[40, 36, 44, 38], max_response=12)  # 32 rows, long prompts
    groups = traj.group_ids.tolist()
    grouped = mini_batch_rows(traj, 4, torch.Generator().manual_seed(0), shuffle=True, grouped=True)
    row_wise = mini_batch_rows(traj, 4, torch.Generator().manual_seed(0), shuffle=True, grouped=False)
    assert set(_pieces(grouped, groups).values()) == {1} and max(_pieces(row_wise, groups).values()) > 1
    assert sorted(i for m in grouped for i in m) == list(range(len(traj)))
    assert _forward_tokens(traj, grouped, 1000) < 0.75 * _forward_tokens(traj, row_wise, 1000)
    assert mini_batch_rows(traj, 2, torch.Generator(), shuffle=False, grouped=True) == [
        list(range(16)), list(range(16, 32))]


def test_policy_update_shuffles_whole_groups_with_the_shared_layout(monkeypatch):
    from ds_rlhf.recipes import policy_update as module

    seen = []
    monkeypatch.setattr(module, "_mini_batch", lambda actor, critic, exp, rows, cfg, **kw: seen.append(rows))
    traj = _traj(4)
    groups = traj.group_ids.tolist()
    for mode in ("on", "off"):
        cfg = _cfg(mode)
        cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, ppo_epochs=2, mini_batch_size=8))
        seen.clear()
        policy_update(SimpleNamespace(train=lambda: None, get_lr=lambda: [0.0]), None, traj, cfg, kl_coef=0.0,
                      generator=torch.Generator().manual_seed(5))
        assert len(seen) == 2 * 3 and sorted(i for m in seen[:3] for i in m) == list(range(len(traj)))
        whole = all(set(_pieces(m, groups).values()) <= {0, 1} for m in [seen[:3], seen[3:]])
        assert whole == (mode == "on"), (mode, seen)
