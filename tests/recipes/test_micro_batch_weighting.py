"""A batch's loss and gradient do not depend on how `policy_update` cuts it into micro-batches: every aggregation
mode, padded, packed and the shared-prompt layout (its mini-batches of whole groups too), with a row that has no
response token (`rl.overlong_mask`), actor and critic."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ds_rlhf.algos.losses import AGG_MODES
from ds_rlhf.config import Config
from ds_rlhf.recipes.policy_update import policy_update
from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
from ds_rlhf.rollout.base import RolloutSample

# (prompt, response) lengths, two samples per prompt; row 3 is truncated and masked out.
SHAPES = [(3, 5), (6, 1), (2, 9), (5, 4), (4, 7), (7, 2)]
TRUNCATED = 3


def _cfg(agg: str, packing: bool, split: bool, algo: str, shared: bool = False, mini: int = 0) -> Config:
    cfg = Config()
    budget = (16 if split else 1000) if packing else 0  # packing counts real tokens; else rows per micro-batch
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, rl_packing=packing, micro_batch_tokens=budget,
                                      rl_shared_prompt="on" if shared else "off"),
        optim=dataclasses.replace(cfg.optim, micro_batch_size=2 if split else len(SHAPES)),
        rollout=dataclasses.replace(cfg.rollout, max_new_tokens=12),
        rl=dataclasses.replace(cfg.rl, algo=algo, loss_agg=agg, overlong_mask=True, entropy_coef=0.01,
                               mini_batch_size=mini))


def _traj(cfg: Config, critic=None):
    gen = torch.Generator().manual_seed(0)
    samples = [RolloutSample(prompt_index=i // 2, sample_index=i % 2,
                             prompt_ids=torch.randint(10, 400, (p,), generator=gen).tolist(),
                             response_ids=torch.randint(10, 400, (r,), generator=gen).tolist(),
                             logprobs=(-6.0 + torch.rand(r, generator=gen)).tolist(),
                             finish_reason="length" if i == TRUNCATED else "stop")
               for i, (p, r) in enumerate(SHAPES)]
    scores = [0.9, 0.1, 0.2, 0.7, 1.0, 0.3]
    traj = pad_trajectory(samples, scores, pad_id=0, mask_truncated=True)
    assert traj.action_mask[TRUNCATED].sum() == 0 and traj.action_mask.sum(-1).gt(0).sum() == len(SHAPES) - 1
    traj = traj.replace(ref_logp=traj.rollout_logp + 0.1 * traj.action_mask)
    if critic is not None:
        traj = traj.replace(values=0.05 * torch.arange(traj.action_mask.numel()).view_as(traj.action_mask).float())
    return with_advantages(traj, cfg.rl, 0.0)


def _recording(module, grads: list):
    """The slice of DeepSpeedEngine that `policy_update` calls; `step` records the accumulated gradient."""
    module.backward = lambda loss, scale_wrt_gas=True: loss.backward()

    def step():
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        module.zero_grad()

    module.step = step
    return module


@pytest.fixture(scope="module")
def models(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from ds_rlhf.engines.models import CriticModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    actor.config.use_cache = False
    torch.manual_seed(0)
    critic = CriticModel.from_pretrained(tiny_model_path, init_from="actor", dtype="fp32")
    yield actor, critic
    torch.set_num_threads(threads)


def _update(models, agg, packing, split, algo, shared=False, mini=0, steps=1):
    cfg = _cfg(agg, packing, split, algo, shared, mini)
    actor_grads, critic_grads = [], []
    actor = _recording(copy.deepcopy(models[0]), actor_grads)
    critic = _recording(copy.deepcopy(models[1]), critic_grads) if algo == "ppo" else None
    traj = _traj(cfg, critic)
    result = policy_update(actor, critic, traj, cfg, kl_coef=0.05, generator=torch.Generator().manual_seed(3))
    assert len(actor_grads) == steps
    if steps > 1:
        return result.metrics, actor_grads, critic_grads
    return result.metrics, actor_grads[0], (critic_grads[0] if critic_grads else {})


def _same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name, g in a.items():
        assert torch.allclose(g, b[name], atol=1e-7, rtol=1e-4), (name, (g - b[name]).abs().max())


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_and_gradient_do_not_depend_on_the_micro_batch_split(models, agg, packing):
    whole, whole_grads, _ = _update(models, agg, packing, split=False, algo="grpo")
    cut, cut_grads, _ = _update(models, agg, packing, split=True, algo="grpo")
    assert float(whole["actor/loss"]) != 0.0
    for key in ("actor/loss", "actor/kl_loss"):
        assert float(cut[key]) == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), key
    _same_grads(whole_grads, cut_grads)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_value_loss_gradient_does_not_depend_on_the_micro_batch_split(models, agg):
    whole, _, whole_grads = _update(models, agg, False, split=False, algo="ppo")
    cut, _, cut_grads = _update(models, agg, False, split=True, algo="ppo")
    assert float(cut["critic/loss"]) == pytest.approx(float(whole["critic/loss"]), rel=1e-5)
    _same_grads(whole_grads, cut_grads)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_shared_prompt_mini_batches_do_not_depend_on_the_micro_batch_split(models, agg):
    """Three groups of two rows, mini-batches of 4 rows: whole groups (4 + 2 rows) in one micro-batch each or cut
    into micro-batches of one group; each optimizer step's gradient and the mean loss agree."""
    whole, whole_grads, _ = _update(models, agg, False, split=False, algo="grpo", shared=True, mini=4, steps=2)
    cut, cut_grads, _ = _update(models, agg, False, split=True, algo="grpo", shared=True, mini=4, steps=2)
    assert float(whole["actor/loss"]) != 0.0
    for key in ("actor/loss", "actor/kl_loss"):
        assert float(cut[key]) == pytest.approx(float(whole[key]), rel=1e-5, abs=1e-7), key
    for a, b in zip(whole_grads, cut_grads):
        _same_grads(a, b)
