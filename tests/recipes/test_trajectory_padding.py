"""Rollout samples -> padded training tensors; micro-batch splitting."""

from __future__ import annotations

import torch

from ds_rlhf.recipes.batching import split_micro
from ds_rlhf.recipes.trajectory import pad_trajectory
from ds_rlhf.rollout.base import RolloutSample


def _samples():
    return [
        RolloutSample(prompt_index=0, sample_index=0, prompt_ids=[1, 2, 3], response_ids=[7, 8],
                      logprobs=[-0.5, -0.25], finish_reason="stop"),
        RolloutSample(prompt_index=0, sample_index=1, prompt_ids=[1, 2, 3], response_ids=[9, 10, 11, 12],
                      logprobs=[-1.0, -2.0, -3.0, -4.0], finish_reason="length"),
        RolloutSample(prompt_index=1, sample_index=0, prompt_ids=[4, 5], response_ids=[6],
                      logprobs=[-0.125], finish_reason="stop"),
    ]


def test_layout_position_t_scores_token_t_plus_1():
    exp = pad_trajectory(_samples(), [1.0, 0.0, 0.5], pad_id=0)
    assert exp.input_ids.tolist() == [[1, 2, 3, 7, 8, 0, 0], [1, 2, 3, 9, 10, 11, 12], [4, 5, 6, 0, 0, 0, 0]]
    assert exp.attention_mask.sum(1).tolist() == [5, 7, 3]
    # action_mask[t] == 1 exactly when token t+1 is a response token
    for row in range(3):
        targets = exp.input_ids[row, 1:][exp.action_mask[row].bool()].tolist()
        assert targets == _samples()[row].response_ids
        assert exp.rollout_logp[row][exp.action_mask[row].bool()].tolist() == _samples()[row].logprobs
    assert exp.rollout_logp[exp.action_mask == 0].abs().sum() == 0
    assert exp.group_ids.tolist() == [0, 0, 1]
    assert exp.scores.tolist() == [1.0, 0.0, 0.5]


def test_select_trims_to_the_longest_selected_row():
    exp = pad_trajectory(_samples(), [1.0, 0.0, 0.5], pad_id=0)
    sub = exp.select([0, 2])
    assert sub.input_ids.shape == (2, 5) and sub.action_mask.shape == (2, 4)
    assert sub.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 5, 6, 0, 0]]
    assert torch.equal(sub.rollout_logp, exp.rollout_logp[[0, 2], :4])


def test_mismatched_logprob_count_is_an_error():
    bad = _samples()[:1]
    bad[0].logprobs = [-1.0]
    try:
        pad_trajectory(bad, [0.0], pad_id=0)
    except ValueError as exc:
        assert "2 response tokens but 1 log-probs" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_split_micro_by_rows_and_by_token_budget():
    lengths = [10, 3, 7, 4, 9]
    groups = split_micro(lengths, max_tokens=0, max_rows=2)
    assert groups == [[0, 1], [2, 3], [4]]
    budget = split_micro(lengths, max_tokens=12, max_rows=1)
    assert sorted(i for g in budget for i in g) == list(range(5))
    assert all(sum(lengths[i] for i in g) <= 12 or len(g) == 1 for g in budget)
    padded = split_micro(lengths, max_tokens=20, max_rows=1, padded=True)
    assert all(len(g) * max(lengths[i] for i in g) <= 20 or len(g) == 1 for g in padded)
