"""From scores to advantages: where rewards land, group baselines over ragged groups, KL in the reward."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.config import RLConfig
from ds_rlhf.recipes.trajectory import pad_trajectory, shaped_token_rewards, with_advantages
from ds_rlhf.rollout.base import RolloutSample


def _exp(scores, groups=(0, 0, 1, 1)):
    samples = [RolloutSample(prompt_index=g, sample_index=i, prompt_ids=[1, 2], response_ids=[3] * (i + 1),
                             logprobs=[-1.0] * (i + 1), finish_reason="stop") for i, g in enumerate(groups)]
    return pad_trajectory(samples, scores, pad_id=0)


def test_score_lands_on_the_last_response_token():
    exp = _exp([1.0, 2.0, 3.0, 4.0])
    rewards = shaped_token_rewards(exp, RLConfig(), kl_coef=0.0)
    for row in range(4):
        last = int(exp.action_mask[row].nonzero().max())
        assert rewards[row, last] == exp.scores[row]
        assert rewards[row].sum() == exp.scores[row]


def test_kl_in_reward_is_subtracted_per_token():
    exp = _exp([1.0, 0.0, 0.0, 0.0])
    exp = exp.replace(ref_logp=exp.rollout_logp - 0.5 * exp.action_mask)  # log(pi/ref) = 0.5 on every action token
    rl = RLConfig(kl_in="reward", kl_estimator="k1")
    rewards = shaped_token_rewards(exp, rl, kl_coef=0.1)
    expected = -0.05 * exp.action_mask.sum(1) + exp.scores
    assert torch.allclose(rewards.sum(1), expected)


def test_grpo_advantages_are_group_relative_and_constant_per_sequence():
    exp = _exp([1.0, 0.0, 5.0, 5.0])
    exp = with_advantages(exp, RLConfig(algo="grpo"), kl_coef=0.0)
    adv = exp.advantages
    first = [adv[r][exp.action_mask[r].bool()] for r in range(4)]
    assert all(torch.allclose(a, a[0].expand_as(a)) for a in first)
    assert first[0][0] > 0 > first[1][0]
    assert first[2][0] == 0 and first[3][0] == 0  # equal scores in a group: no signal
    assert adv[exp.action_mask == 0].abs().sum() == 0


def test_a_group_that_lost_all_but_one_sample_gets_no_signal():
    exp = _exp([1.0, 0.0, 7.0], groups=(0, 0, 1))
    exp = with_advantages(exp, RLConfig(algo="rloo"), kl_coef=0.0)
    assert exp.advantages[2].abs().sum() == 0
    assert exp.advantages[0].sum() > 0


def test_ppo_needs_values_and_fills_returns():
    exp = _exp([1.0, 0.0, 0.5, 0.2])
    with pytest.raises(ValueError, match="critic values"):
        with_advantages(exp, RLConfig(algo="ppo"), kl_coef=0.0)
    exp = exp.replace(values=torch.zeros_like(exp.action_mask))
    exp = with_advantages(exp, RLConfig(algo="ppo", gamma=1.0, lam=1.0), kl_coef=0.0)
    # gamma = lambda = 1 and zero values: the return at every action token is the sequence score
    for row in range(4):
        valid = exp.action_mask[row].bool()
        assert torch.allclose(exp.returns[row][valid], exp.scores[row].expand(int(valid.sum())))


def test_unknown_algo_is_rejected():
    with pytest.raises(ValueError, match="unknown rl.algo"):
        with_advantages(_exp([0.0] * 4), RLConfig(algo="dpo"), kl_coef=0.0)
