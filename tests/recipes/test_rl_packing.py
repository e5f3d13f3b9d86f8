"""Packed RL micro-batches (`data.rl_packing`): one padding-free row per micro-batch gives the padded rows' numbers.

Every comparison runs the same rows both ways on the fp32 tiny model: log-probs, entropy, critic values, the
actor's parameter gradients, and whole `policy_update`s (metrics and the weights they leave).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ds_rlhf.config import Config, ConfigError
from ds_rlhf.recipes.packed_batch import pack_rows
from ds_rlhf.recipes.policy_update import (
    actor_micro_step,
    forward_logprobs,
    forward_values,
    micro_logprobs,
    micro_values,
    policy_update,
)
from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
from ds_rlhf.rollout.base import RolloutSample
from tests.recipes import policy_fixtures
from tests.recipes.policy_fixtures import as_engine

actor, one_thread = policy_fixtures.actor, policy_fixtures.one_thread  # the module's fixtures

# (prompt, response) lengths: ragged, one response of a single token, one row as long as the batch.
SHAPES = [(3, 5), (6, 1), (2, 9), (5, 4), (4, 7), (7, 2), (3, 3), (2, 6)]


def _traj(cfg: Config, shapes=SHAPES, seed: int = 0, advantages: bool = True):
    gen = torch.Generator().manual_seed(seed)
    samples = [RolloutSample(prompt_index=i // 2, sample_index=i % 2,
                             prompt_ids=torch.randint(10, 400, (p,), generator=gen).tolist(),
                             response_ids=torch.randint(10, 400, (r,), generator=gen).tolist(),
                             logprobs=(-6.0 + torch.rand(r, generator=gen)).tolist(), finish_reason="stop")
               for i, (p, r) in enumerate(shapes)]
    scores = torch.rand(len(samples), generator=gen).tolist()
    traj = pad_trajectory(samples, scores, pad_id=0)
    return with_advantages(traj, cfg.rl, 0.0) if advantages else traj


def _cfg(packing: bool, budget: int = 40, **rl) -> Config:
    """Packed or padded rows (the shared-prompt layout off: its whole-group mini-batches are tested apart)."""
    cfg = Config()
    data = dataclasses.replace(cfg.data, rl_packing=packing, micro_batch_tokens=budget, rl_shared_prompt="off")
    return dataclasses.replace(cfg, data=data, rl=dataclasses.replace(cfg.rl, **rl))


@pytest.fixture(scope="module")
def critic(tiny_model_path):
    from ds_rlhf.engines.models import CriticModel

    torch.manual_seed(0)  # the fresh value head
    return CriticModel.from_pretrained(tiny_model_path, init_from="actor", dtype="fp32")


def test_pack_rows_layout_and_round_trip():
    traj = _traj(_cfg(True))
    packed = pack_rows(traj.input_ids, traj.attention_mask)
    lens = traj.seq_lens
    assert packed.input_ids.shape == (1, int(lens.sum())) and torch.equal(packed.seq_lens, lens)
    assert packed.cu_seqlens.tolist() == [0, *torch.cumsum(lens, 0).tolist()]
    cu = packed.cu_seqlens.tolist()
    for i, n in enumerate(lens.tolist()):  # tokens in order, positions restarting at 0
        assert packed.input_ids[0, cu[i]:cu[i + 1]].tolist() == traj.input_ids[i, :n].tolist()
        assert packed.position_ids[0, cu[i]:cu[i + 1]].tolist() == list(range(n))
    # the packed row's own next-token targets, gathered back, are exactly each row's targets
    targets = packed.unpack(packed.input_ids[:, 1:])
    scored = packed.scored
    assert torch.equal(scored, torch.arange(lens.max() - 1)[None, :] < (lens - 1)[:, None])
    assert torch.equal(targets[scored], traj.input_ids[:, 1:][scored]) and (targets[~scored] == 0).all()
    # no cross-sequence position (last token of sequence i -> first of i+1) is ever read
    boundaries = set(x - 1 for x in cu[1:])
    assert not boundaries & set(packed.gather_index[scored].tolist())
    assert len(set(packed.gather_index[scored].tolist())) == int(scored.sum()) == int((lens - 1).sum())
    assert bool((traj.action_mask.bool() <= scored).all())  # every trained token is scored
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(traj.input_ids, traj.attention_mask.flip(1))


def test_packed_mask_marks_the_packed_positions_of_the_masked_padded_ones():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11], [12, 13, 0, 0]])
    attn = (ids > 0).long()
    packed = pack_rows(ids, attn)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[0, 1] = mask[1, 0] = mask[1, 2] = mask[2, 0] = True
    mask[2, 2] = True  # past row 2's end: scored by no packed position
    got = packed.packed_mask(mask)
    assert got.shape == (1, packed.num_tokens - 1)
    # rows start at packed 0, 3, 7: (0,1) -> 1, (1,0) -> 3, (1,2) -> 5, (2,0) -> 7
    assert got[0].nonzero().squeeze(1).tolist() == [1, 3, 5, 7]
    values = torch.arange(packed.num_tokens - 1, dtype=torch.float32)[None] + 1
    assert torch.equal(packed.unpack(values * got) != 0, mask & packed.scored)


def test_unpack_is_differentiable():
    traj = _traj(_cfg(True), shapes=SHAPES[:3])
    packed = pack_rows(traj.input_ids, traj.attention_mask)
    leaf = torch.randn(1, packed.num_tokens - 1, requires_grad=True)
    (packed.unpack(leaf) * 2).sum().backward()
    expect = torch.zeros(packed.num_tokens - 1)
    expect[packed.gather_index[packed.scored]] = 2.0
    assert torch.equal(leaf.grad[0], expect)  # boundary positions get no gradient


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_entropy_and_values_match_padded(actor, critic, attn):
    actor.config._attn_implementation = attn
    critic.config._attn_implementation = attn
    try:
        mb = _traj(_cfg(True))
        scored = pack_rows(mb.input_ids, mb.attention_mask).scored
        with torch.no_grad():
            padded = micro_logprobs(actor, mb, _cfg(False), with_entropy=True)
            packed = micro_logprobs(actor, mb, _cfg(True), with_entropy=True)
            values = micro_values(critic, mb, _cfg(False)), micro_values(critic, mb, _cfg(True))
    finally:
        actor.config._attn_implementation = "sdpa"
        critic.config._attn_implementation = "sdpa"
    for a, b in (*zip(padded, packed), values):
        assert a.shape == b.shape == mb.action_mask.shape
        assert torch.allclose(a[scored], b[scored], atol=1e-5), (a - b)[scored].abs().max()
        assert (b[~scored] == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_gradients_match_padded(actor, agg):
    rl = dict(loss_agg=agg, entropy_coef=0.01)
    mb = _traj(_cfg(True, **rl))
    mb = mb.replace(ref_logp=mb.rollout_logp + 0.1 * mb.action_mask)
    grads, results = [], []
    for packing in (False, True):
        model = as_engine(actor)
        model.zero_grad()
        metrics, logp = actor_micro_step(model, mb, _cfg(packing, **rl), kl_coef=0.05, share=0.375)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        results.append((metrics, logp))
    actor.zero_grad()
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-4), name
    assert grads[0]["model.embed_tokens.weight"].abs().sum() > 0
    (m0, logp0), (m1, logp1) = results
    assert m0.keys() == m1.keys()
    for key in m0:
        assert float(m0[key]) == pytest.approx(float(m1[key]), abs=1e-5), key
    assert torch.allclose(logp0 * mb.action_mask, logp1 * mb.action_mask, atol=1e-5)


def _run(actor, critic, packing: bool, rl: dict, budget: int = 40):
    cfg = _cfg(packing, budget, **rl)
    actor, critic = as_engine(copy.deepcopy(actor)), (as_engine(copy.deepcopy(critic)) if critic else None)
    traj = _traj(cfg, advantages=critic is None)
    if rl.get("ppo_epochs", 1) > 1:
        traj = traj.replace(old_logp=forward_logprobs(actor, traj, cfg))
    if critic is not None:
        traj = with_advantages(traj.replace(values=forward_values(critic, traj, cfg)), cfg.rl, 0.0)
    result = policy_update(actor, critic, traj, cfg, kl_coef=0.0, generator=torch.Generator().manual_seed(3))
    return result, actor, traj


@pytest.mark.parametrize("rl,budget", [(dict(algo="grpo"), 40), (dict(algo="ppo", ppo_epochs=2, mini_batch_size=4), 40),
                                       (dict(algo="ppo", ppo_epochs=2, mini_batch_size=4), 200)],
                         ids=["grpo-single-update", "ppo-2-epochs-split-differs", "ppo-one-micro-per-mini"])
def test_ppo_update_packed_matches_padded(actor, critic, rl, budget):
    """Budget 40: several micro-batches per mini-batch, grouped differently padded (rows x longest) and packed
    (real tokens); the share weighting makes the update the same. Budget 200: one micro-batch per mini-batch."""
    ppo = rl["algo"] == "ppo"
    (r0, a0, t0), (r1, a1, t1) = (_run(actor, critic if ppo else None, packing, rl, budget)
                                  for packing in (False, True))
    if ppo:
        assert torch.allclose(t0.old_logp, t1.old_logp, atol=1e-5)
        assert torch.allclose(t0.values, t1.values, atol=1e-5)
    assert torch.allclose(r0.trainer_logp, r1.trainer_logp, atol=1e-5)
    assert r0.metrics.keys() == r1.metrics.keys()
    for key, value in r0.metrics.items():
        if key == "critic/vf_clip_frac":
            continue  # counts ties broken by rounding where V == V_old (first mini-batch): noise, padded or packed
        if key.endswith(("_min", "_max", "explained_var")) and budget < 100:
            continue  # per-micro-batch extremes / variances, averaged: they depend on the split, which differs here
        assert r1.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for (name, p0), p1 in zip(a0.named_parameters(), a1.parameters()):
        assert torch.allclose(p0, p1, atol=1e-6), name
    assert r0.metrics["actor/optimizer_steps"] == (4 if ppo else 1)


def test_packing_needs_a_token_budget(actor):
    with pytest.raises(ConfigError, match="data.micro_batch_tokens"):
        forward_logprobs(actor, _traj(_cfg(True)), _cfg(True, budget=0))
