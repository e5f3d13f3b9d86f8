"""A reward is a real number: a bool or a string from a reward function is refused under every `reward.on_bad`
policy, naming the function; a reward server's or an OpenRLHF function's `extra_logs` are metrics, never the
reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_rlhf.rewards import BadRewardError, RewardSet, score_samples
from ds_rlhf.rewards.calling import to_outcome
from ds_rlhf.rewards.remote import RemoteReward
from ds_rlhf.rewards.reward_set import RewardSpec

ITEMS = [{"prompt": "p", "response": r, "ground_truth": "1", "metadata": {}, "id": f"s{i}"}
         for i, r in enumerate(["yes", "no"])]


def says_yes(prompt, response, ground_truth, metadata):
    return response == "yes"


def numpy_yes(prompt, response, ground_truth, metadata):
    return np.bool_(response == "yes")


def text_score(prompt, response, ground_truth, metadata):
    return "1.0"


@pytest.mark.parametrize("policy", ["fail", "zero", "drop"])
@pytest.mark.parametrize("fn,kind", [(says_yes, "bool"), (numpy_yes, "bool"), (text_score, "string")])
def test_a_bool_or_a_string_reward_is_refused_naming_the_function(fn, kind, policy):
    with pytest.raises(BadRewardError, match=rf"reward function {fn.__name__} returned .*a {kind} is not a reward"):
        score_samples(fn, ITEMS, policy)


def test_bool_and_string_scores_in_a_dict_and_as_tensors_are_refused():
    for value in ({"score": True}, torch.tensor(True), "0.5", b"1"):
        assert "is not a reward" in to_outcome(value), value
    assert to_outcome({"score": 1, "ok": True}) == (1.0, {})  # a bool beside the score is no metric either
    assert to_outcome(np.float32(0.5)) == (0.5, {}) and to_outcome(2) == (2.0, {})


def test_openrlhf_extra_logs_never_replace_the_rewards():
    def reward_func(queries, prompts, labels):
        return {"rewards": [0.5, 0.25], "extra_logs": {"score": [9.0, 9.0], "length": [3, 2]}}

    rewards = RewardSet([RewardSpec(reward_func)])
    report = score_samples(rewards, ITEMS, "fail")
    assert report.scores == [0.5, 0.25]
    assert report.extras["reward_func/extra_score"] == [9.0, 9.0]
    assert report.extras["reward_func/length"] == [3.0, 2.0]


def test_a_reward_servers_extra_logs_never_replace_its_rewards():
    remote = RemoteReward("http://127.0.0.1:9/score")
    reply = b'{"rewards": [0.5, 0.0], "extra_logs": {"score": [9.0, 8.0], "len": [1, 2]}}'
    values = remote._parse(reply, 2)
    assert [to_outcome(v) for v in values] == [(0.5, {"extra_score": 9.0, "len": 1.0}),
                                                (0.0, {"extra_score": 8.0, "len": 2.0})]
    assert remote._parse(b'{"rewards": [0.5], "extra_logs": {"score": [9.0, 1.0]}}', 1) == [0.5]
