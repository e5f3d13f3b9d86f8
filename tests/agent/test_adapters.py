"""Environments written for TRL (`environment_factory`, `tools=`) and OpenRLHF (`AgentExecutor` / `AgentInstance`,
the older `step` function), loaded the way `--env.name` loads them and played by the episode runner against
a scripted policy: observations, rewards and done flags arrive as each framework's contract says."""

from __future__ import annotations

import json
import textwrap

import pytest
from scripted_policy import ScriptedPolicy

from ds_rlhf.agent.adapters import load_environment
from ds_rlhf.agent.episode import EpisodeRunner
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.rollout import SamplingSpec
from tests.agent.test_rl_episodes import ScriptedAnswers, episode_args

SPEC = SamplingSpec(max_new_tokens=128, temperature=1.0, seed=0)

TRL_ENV = '''
class CounterEnv:
    """TRL environment_factory shape: public methods are tools, reset(**row), get_reward()."""

    def __init__(self):
        self.counter = None

    def reset(self, **kwargs):
        self.counter = kwargs["start"]
        return f" The counter starts at {self.counter}."

    def increment(self, a: int) -> int:
        """Add to the counter.

        Args:
            a: how much to add
        """
        self.counter += a
        return self.counter

    async def fail(self) -> str:
        """Always fails."""
        raise ValueError("not today")

    def get_reward(self) -> float:
        return float(self.counter == 5)

    def _helper(self):
        return "private"
'''

TRL_TOOLS = '''
import asyncio


def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: the word
    """
    return {"cat": "animal"}.get(word, "unknown")


async def shout(word: str) -> str:
    """Shout a word.

    Args:
        word: the word
    """
    await asyncio.sleep(0)
    return word.upper()


TOOLS = [lookup, shout]
'''

OPENRLHF_AGENT = '''
import torch


class AgentInstanceBase:  # openrlhf.utils.agent.AgentInstanceBase
    pass


class MultiTurnAgentExecutor:  # openrlhf.utils.agent.MultiTurnAgentExecutor: keeps the instance class
    def __init__(self, agent_instance_cls):
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"] + " Answer with a number."}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        correct = states["action_text"].strip() == str(states["label"])
        wrong_before = states["observation_text"].count("Wrong")
        done = correct or self.step_idx >= 3
        reward = torch.tensor(1.0) if correct else torch.tensor(0)
        return {"rewards": reward, "scores": reward, "done": done,
                "environment_feedback": "Right." if correct else f"Wrong ({wrong_before} before).",
                "sampling_params": states.get("sampling_params", None), "extra_logs": {"n": self.step_idx}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)


class TokenExecutor:  # a fully custom executor: generates tokens itself
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError


class Resampling(AgentInstance):
    async def step(self, states: dict, **kwargs):
        return {**await super().step(states), "sampling_params": {"temperature": 0.1}}
'''

OPENRLHF_STEP = '''
import torch

calls = []


async def step(observation, action, label, **kwargs):
    calls.append(observation)
    done = action.strip() == str(label)
    feedback = "\\nHuman: correct" if done else "\\nHuman: try again"
    return {"rewards": torch.tensor(float(done)), "scores": torch.tensor(float(done)),
            "next_observation": observation + action + feedback, "done": done, "sampling_params": None,
            "extra_logs": {}}
'''


TRL_CALCULATOR = '''
class TRLCalculator:
    def reset(self, **kwargs):
        self.answer, self.result = int(kwargs["answer"]), None

    def calculator(self, expression: str) -> int:
        """Evaluate two whole numbers and an operator.

        Args:
            expression: e.g. 12 * 3
        """
        a, op, b = expression.split()
        self.result = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        return self.result

    def get_reward(self) -> float:
        return float(self.result == self.answer)
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def play(tokenizer, factory, script, rows, **kw):
    policy = ScriptedPolicy(tokenizer, script, end_of_turn_id(tokenizer))
    runner = EpisodeRunner(policy, tokenizer, factory, SPEC, **kw)
    return runner.run(rows), policy


def contents(ep):
    return [[turn["content"] for turn in step] for step in ep.observations]


def test_trl_environment_factory_class(tiny_tokenizer, tmp_path):
    factory = load_environment(write(tmp_path, "trl_env.py", TRL_ENV) + ":CounterEnv")
    assert sorted(factory().tools) == ["fail", "increment"]  # not reset, get_reward or _helper
    script = {"alpha": ["increment(2)", "fail()", "increment(3)", "It is 5."],
              "beta": ["increment(2)", "It is 3."]}
    rows = [{"prompt": "Count alpha.", "start": 0}, {"prompt": "Count beta.", "start": 0}]
    (a, b), _ = play(tiny_tokenizer, factory, script, rows, max_turns=6)
    prompt = tiny_tokenizer.decode(a.token_ids[:a.prompt_length])
    assert "Count alpha. The counter starts at 0." in prompt and "increment(a: integer)" in prompt
    assert "get_reward" not in prompt and "reset" not in prompt
    results = [c[0].rsplit("\n", 1)[-1] for c in contents(a)]  # a tool turn's content (or its user-turn form)
    assert results == ["2", "{'error': 'not today'}", "5"]
    assert a.reports == [{"turn": 2, "tool": "fail", "status": "error", "error": "ValueError: not today"}]
    assert (a.end, a.turns, a.turn_rewards, a.done) == ("done", 4, [0.0, 0.0, 0.0, 1.0], True)
    assert (b.end, b.turn_rewards, contents(b)[0][0].rsplit("\n", 1)[-1]) == ("done", [0.0, 0.0], "2")


def test_trl_tools_list_sync_and_async(tiny_tokenizer, tmp_path):
    factory = load_environment(write(tmp_path, "trl_tools.py", TRL_TOOLS) + ":TOOLS")
    script = {"gamma": ['lookup("cat")', 'shout("hi")', "Done."]}
    (ep,), _ = play(tiny_tokenizer, factory, script, ["Use gamma tools."])
    assert [c[0].rsplit("\n", 1)[-1] for c in contents(ep)] == ["animal", "HI"]
    assert (ep.end, ep.turn_rewards, ep.reports) == ("done", [0.0, 0.0, 0.0], [])


@pytest.mark.parametrize("name", ["AgentExecutor", "AgentInstance"])
def test_openrlhf_agent_instance(tiny_tokenizer, tmp_path, name):
    factory = load_environment(write(tmp_path, "agent_func.py", OPENRLHF_AGENT) + f":{name}")
    script = {"delta": ["41", "42"], "omega": ["1", "2", "3"]}
    rows = [{"prompt": "delta: what is 6 * 7?", "answer": 42}, {"prompt": "omega: what is 3 * 3?", "label": 9}]
    (right, wrong), _ = play(tiny_tokenizer, factory, script, rows, max_turns=5)
    assert "delta: what is 6 * 7? Answer with a number." in tiny_tokenizer.decode(right.token_ids)
    assert (right.end, right.turn_rewards, contents(right)) == ("done", [0.0, 1.0], [["Wrong (0 before)."]])
    # done after the third step; each step saw the feedback of the steps before it in observation_text
    assert (wrong.end, wrong.turns, wrong.turn_rewards) == ("done", 3, [0.0, 0.0, 0.0])
    assert contents(wrong) == [["Wrong (0 before)."], ["Wrong (1 before)."]]


def test_openrlhf_step_function(tiny_tokenizer, tmp_path):
    path = write(tmp_path, "agent_step.py", OPENRLHF_STEP)
    factory = load_environment(path + ":step")
    (ep,), _ = play(tiny_tokenizer, factory, {"sigma": ["7", "8"]}, [{"prompt": "sigma: 4 + 4?", "answer": 8}])
    assert (ep.end, ep.turn_rewards, contents(ep)) == ("done", [0.0, 1.0], [["\nHuman: try again"]])
    env = factory()
    env.reset({"prompt": "sigma: 4 + 4?", "answer": 8})
    env.step("7")
    assert env.step("8") == ("\nHuman: correct", 1.0, True)
    assert env.fn.__globals__["calls"][-2:] == ["sigma: 4 + 4?", "sigma: 4 + 4?7\nHuman: try again"]


def test_openrlhf_step_asking_for_sampling_params_fails_its_episode(tiny_tokenizer, tmp_path):
    factory = load_environment(write(tmp_path, "agent_func.py", OPENRLHF_AGENT) + ":Resampling")
    (ep,), _ = play(tiny_tokenizer, factory, {"delta": ["41"]}, [{"prompt": "delta?", "answer": 42}])
    assert ep.end == "error" and "returned sampling_params" in ep.reports[0]["error"]


@pytest.mark.parametrize("module, name, words", [
    (OPENRLHF_AGENT, "TokenExecutor", "TokenExecutor has no agent_instance_cls with a step method"),
    ("class Bare:\n    def reset(self, **kw):\n        return None\n", "Bare",
     "class Bare has reset but no step, no public tool methods and no get_reward"),
    ("class AgentInstance:\n    async def __init__(self):\n        pass\n    async def step(self, states):\n"
     "        return {}\n", "AgentInstance", "AgentInstance.__init__ is async def"),
    ("class Hintless:\n    def reset(self, **kw):\n        return None\n    def go(self, x):\n        return x\n",
     "Hintless", "tool go: "),
])
def test_unmappable_shapes_are_refused_in_one_line(tmp_path, module, name, words):
    with pytest.raises(ConfigError) as err:
        load_environment(write(tmp_path, "peer.py", module) + f":{name}")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_rl_environment_trains_on_a_trl_environment(tiny_model_path, tiny_tokenizer, arithmetic_store, dist_single,
                                                    tmp_path):
    """`--env.name file.py:TRLCalculator` in a GRPO step: every episode calls the class's calculator method,
    then answers; `get_reward` (the tool's result equals the row's answer) is the episode's reward."""
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)
    args[args.index("--env.name") + 1] = write(tmp_path, "trl_calc.py", TRL_CALCULATOR) + ":TRLCalculator"
    engine = ScriptedAnswers(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    (h,) = RLTrainer(parse_config(args), rollout=engine).train()
    assert h["episode/turns_mean"] == pytest.approx(2.0) and h["episode/tool_call_rate"] == pytest.approx(0.5)
    assert h["episode/reward_mean"] == pytest.approx(1.0) == h["reward/mean"] and h["episode/error_frac"] == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "episode/turns_mean" in m] == [1]
