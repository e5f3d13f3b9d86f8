"""GAE and the value loss over a multi-turn episode's action mask: the generated tokens are the steps of one chain
across the observation spans; observation tokens get no advantage, no return and no value loss."""

from __future__ import annotations

import torch

from ds_rlhf.algos import compute_advantages, gae, token_rewards_from_scores, value_loss

OBS = 9.0  # what sits at observation positions of the hand table: read by nothing


def textbook_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """Dense GAE over every position of each row (no mask), as in the textbook loop."""
    adv = torch.zeros_like(rewards)
    last, next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype), torch.zeros(rewards.shape[0],
                                                                                       dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t], next_value = last, values[:, t]
    return adv, adv + values


def test_gae_with_an_all_ones_mask_is_the_dense_textbook_gae_on_a_random_table():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
        adv, ret = gae(rewards, values, torch.ones(5, 11, dtype=torch.bool), gamma, lam)
        ref_adv, ref_ret = textbook_gae(rewards, values, gamma, lam)
        torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


# One episode row: turn 1 (positions 0-1), an observation (2-3), turn 2 (4-5), right padding (6).
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
VALUES = torch.tensor([[0.5, 1.0, OBS, OBS, 2.0, 1.0, 0.0]], dtype=torch.float64)
REWARDS = torch.tensor([[0.0, 0.0, OBS, OBS, 0.0, 2.0, 0.0]], dtype=torch.float64)
GAMMA = LAM = 0.5  # gamma * lam = 0.25


def test_gae_over_an_episode_chains_the_generated_tokens_across_the_observation_by_hand():
    # t=5 (last generated token): delta = 2 + 0.5 * 0 - 1 = 1;               A = 1;                       R = 2
    # t=4:                        delta = 0 + 0.5 * V5 - V4 = 0.5 - 2 = -1.5; A = -1.5 + 0.25 * 1 = -1.25; R = 0.75
    # t=1 (before the observation; its next step is t=4, not t=2):
    #                             delta = 0 + 0.5 * V4 - V1 = 1 - 1 = 0;      A = 0.25 * -1.25 = -0.3125;  R = 0.6875
    # t=0:                        delta = 0 + 0.5 * V1 - V0 = 0.5 - 0.5 = 0;  A = 0.25 * -0.3125 = -0.078125;
    #                                                                                                  R = 0.421875
    # t=2, 3 (observation), t=6 (padding): A = R = 0
    adv, ret = gae(REWARDS, VALUES, MASK, GAMMA, LAM)
    assert adv.tolist() == [[-0.078125, -0.3125, 0.0, 0.0, -1.25, 1.0, 0.0]]
    assert ret.tolist() == [[0.421875, 0.6875, 0.0, 0.0, 0.75, 2.0, 0.0]]


def test_values_and_rewards_at_observation_positions_change_no_advantage_or_return():
    base_adv, base_ret = gae(REWARDS, VALUES, MASK, GAMMA, LAM)
    base_ppo = compute_advantages("ppo", rewards=REWARDS, values=VALUES, mask=MASK, gamma=GAMMA, lam=LAM)
    observation = torch.tensor([[False, False, True, True, False, False, False]])
    for fill_v, fill_r in ((-100.0, 0.0), (0.0, 50.0), (1e6, -3.0), (float("nan"), float("nan"))):
        values = torch.where(observation, fill_v, VALUES)
        rewards = torch.where(observation, fill_r, REWARDS)
        adv, ret = gae(rewards, values, MASK, GAMMA, LAM)
        assert torch.equal(adv, base_adv) and torch.equal(ret, base_ret), (fill_v, fill_r)
        # the PPO estimator (GAE, then whitening over the action tokens) as the trainer calls it
        ppo = compute_advantages("ppo", rewards=rewards, values=values, mask=MASK, gamma=GAMMA, lam=LAM)
        assert torch.equal(ppo[0], base_ppo[0]) and torch.equal(ppo[1], base_ppo[1]), (fill_v, fill_r)
    assert (base_ppo[0][observation] == 0).all() and (base_ppo[1][observation] == 0).all()


def test_value_loss_and_its_gradient_do_not_depend_on_observation_positions():
    observation = torch.tensor([[False, False, True, True, False, False, False]])
    _, returns = gae(REWARDS, VALUES, MASK, GAMMA, LAM)
    old_values = VALUES - 0.3
    for clip in (None, 0.2):
        losses, grads = [], []
        for fill in (0.0, 7.0, -1e3):
            values = torch.where(observation, fill, VALUES + 0.4).requires_grad_(True)
            old = torch.where(observation, -fill, old_values)
            target = torch.where(observation, fill * 2, returns)
            loss, metrics = value_loss(values, old, target, MASK, clip=clip)
            loss.backward()
            losses.append(loss.detach())
            grads.append(values.grad)
            assert (values.grad[observation] == 0).all()
            assert metrics["value_mean"] == (VALUES + 0.4)[MASK].mean()
        assert all(torch.equal(x, losses[0]) for x in losses), (clip, losses)
        assert all(torch.equal(g, grads[0]) for g in grads), clip
        if clip is None:  # every generated token's value is trained (clipped: where the clipped term is smaller)
            assert (grads[0][MASK] != 0).all()


def test_the_episode_score_and_the_kl_shaping_land_on_generated_tokens_only():
    # the second row ends on an observation (an episode truncated after a tool result): its score goes to its last
    # generated token (t=1), where GAE reads it undecayed, not to the observation after it
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    kl = torch.full((2, 7), 0.5, dtype=torch.float64)
    rewards = token_rewards_from_scores(torch.tensor([2.0, 3.0], dtype=torch.float64), mask, kl=kl, kl_coef=0.2)
    assert rewards.tolist() == [[-0.1, -0.1, 0.0, 0.0, -0.1, 1.9, 0.0], [-0.1, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0]]
