"""An environment's reward is a real number: a bool or a string stops the episode runner with one line naming the
environment (whatever `env.on_bad_tool` says); a value not finite in float32 (1e300) ends its episode as failed."""

from __future__ import annotations

import agent_helpers as h
import pytest
from scripted_policy import ScriptedPolicy

from ds_rlhf.agent.adapters import OpenRLHFStepFunction
from ds_rlhf.agent.environment import ToolEnvironment, run_step
from ds_rlhf.agent.episode import EpisodeRunner
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.rewards import BadRewardError
from ds_rlhf.rollout import SamplingSpec

SPEC = SamplingSpec(max_new_tokens=64, temperature=1.0, seed=0)


def env_with_reward(value):
    class Rewarding(h.EchoEnv):
        def step(self, action_text):
            return "ok", value, True

    return Rewarding


@pytest.mark.parametrize("value,kind", [("1.0", "string"), (True, "bool"), (b"1", "string")])
def test_a_string_or_bool_environment_reward_is_refused(value, kind):
    env = env_with_reward(value)()
    env.reset("row")
    with pytest.raises(BadRewardError, match=rf"environment Rewarding.step returned .*a {kind} is not a reward"):
        run_step(env, "answer")


@pytest.mark.parametrize("value", [1e300, float("nan"), -float("inf")])
def test_an_environment_reward_not_finite_in_float32_fails_the_step(value):
    with pytest.raises(ValueError, match="not finite in float32"):
        run_step(env_with_reward(value)(), "answer")


def test_numbers_of_every_kind_are_rewards():
    import numpy as np
    import torch

    for value, expected in ((1, 1.0), (0.5, 0.5), (np.float64(2.0), 2.0), (torch.tensor(3.0), 3.0)):
        assert run_step(env_with_reward(value)(), "answer").reward == expected


def test_tool_environment_and_openrlhf_rewards_are_checked_too():
    tools = ToolEnvironment([h.add], reward_fn=lambda text, row: "1")
    tools.reset("row")
    with pytest.raises(BadRewardError, match="ToolEnvironment's reward returned str '1'"):
        tools.step("no call here")

    def step(observation, action, label, **kwargs):
        return {"rewards": True, "next_observation": observation + action, "done": True}

    with pytest.raises(BadRewardError, match="step's rewards returned bool True"):
        OpenRLHFStepFunction(step).step("answer")


def test_the_episode_runner_stops_on_a_refused_reward(tiny_tokenizer):
    policy = ScriptedPolicy(tiny_tokenizer, {"one": ["fine"], "two": ["fine"]}, end_of_turn_id(tiny_tokenizer))
    with pytest.raises(BadRewardError, match="returned str '1.0'"):
        EpisodeRunner(policy, tiny_tokenizer, env_with_reward("1.0"), SPEC).run(["one", "two"])
    one, two = EpisodeRunner(policy, tiny_tokenizer, env_with_reward(1e300), SPEC).run(["one", "two"])
    assert one.end == two.end == "error" and "not finite in float32" in one.reports[0]["error"]
