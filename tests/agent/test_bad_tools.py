"""Environments that hang, raise or flood: `env.step_timeout` ends a hung reset / step's episode and the runner
goes on (the hung thread abandoned), an oversized observation ends its episode, `env.on_bad_tool` fail / zero / drop
does what it says, and each episode's reports and per-step rewards reach the metrics and samples.jsonl."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import agent_helpers as h
import pytest
import torch
from scripted_policy import ScriptedPolicy

from ds_rlhf.agent.environment import ToolEnvironment
from ds_rlhf.agent.episode import BadToolError, EpisodeRunner
from ds_rlhf.algos.advantages import reinforce_pp_returns
from ds_rlhf.config import Config, help_text, parse_config
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.errors import ConfigError, UserInputError
from ds_rlhf.recipes.reward_stage import RewardStage
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.trajectory import RolloutBatch, pad_trajectory, with_advantages
from ds_rlhf.rollout import SamplingSpec
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.telemetry.samples import read_samples
from tests.agent.test_rl_episodes import ScriptedAnswers, episode_args

SPEC = SamplingSpec(max_new_tokens=64, temperature=1.0, seed=0)
RELEASE = threading.Event()
FLAKY = f"{Path(__file__).parent / 'flaky_calculator.py'}:FlakyCalculatorEnv"


@pytest.fixture(autouse=True)
def release_hung_threads():
    """Hung environment calls wait on RELEASE; set after each test so the abandoned threads end."""
    RELEASE.clear()
    yield
    RELEASE.set()


class HangingEcho(h.EchoEnv):
    """EchoEnv, except that the first step of an episode whose row contains "hang" hangs."""

    def reset(self, row):
        self.row = row
        return super().reset(row)

    def step(self, action_text):
        if "hang" in self.row:
            RELEASE.wait(60)
        return super().step(action_text)


class AsyncHangingEcho(h.EchoEnv):
    """HangingEcho with `async def` methods (the hang awaits)."""

    async def reset(self, row):
        self.row = row
        return h.EchoEnv.reset(self, row)

    async def step(self, action_text):
        while "hang" in self.row and not RELEASE.is_set():
            await asyncio.sleep(0.02)
        return h.EchoEnv.step(self, action_text)


class HangingReset(h.EchoEnv):
    def reset(self, row):
        if "hang" in row:
            RELEASE.wait(60)
        return super().reset(row)


class Flood(h.EchoEnv):
    """One step whose observation is `size` bytes."""

    size = 0

    def step(self, action_text):
        return "x" * self.size, 1.0, False


def run_bounded(runner: EpisodeRunner, rows, seconds: float = 30.0):
    """`runner.run(rows)` in a thread; fails when it has not returned within `seconds`."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(runner.run(rows)), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert out, f"the runner did not return within {seconds} s: a hung environment call held it"
    return out[0], time.monotonic() - start


@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("env", [HangingEcho, AsyncHangingEcho], ids=["sync", "async"])
def test_a_hanging_step_ends_its_episode_at_the_timeout_and_the_next_step_runs(tiny_tokenizer, env, lockstep):
    policy = ScriptedPolicy(tiny_tokenizer, {"hang": ["first"], "fine": ["one", "two"]},
                            end_of_turn_id(tiny_tokenizer))
    # one worker: the fine episode's steps can only run once the hung call's slot is given up
    runner = EpisodeRunner(policy, tiny_tokenizer, env, SPEC, max_turns=4, max_workers=1, step_timeout=0.5,
                           lockstep=lockstep)
    (hung, fine), seconds = run_bounded(runner, ["hang", "fine"])
    assert (hung.end, hung.bad, hung.turns, hung.turn_rewards) == ("timeout", True, 1, [])
    assert [(r["turn"], r["status"]) for r in hung.reports] == [(1, "timeout")]
    assert hung.reports[0]["error"].startswith("step: StepTimeout: no result within 0.5 s")
    assert (fine.end, fine.bad, fine.turns, fine.turn_rewards, fine.reports) == ("done", False, 2, [0.0, 1.0], [])
    assert seconds < 20


def test_an_async_step_past_the_deadline_is_cancelled_not_abandoned(tiny_tokenizer):
    cancelled = threading.Event()

    class SleepsForever(h.EchoEnv):
        async def step(self, action_text):
            try:
                await asyncio.sleep(60)
            finally:
                cancelled.set()  # runs only when the coroutine is cancelled (or after a minute)

    policy = ScriptedPolicy(tiny_tokenizer, {"slow": ["first"]}, end_of_turn_id(tiny_tokenizer))
    runner = EpisodeRunner(policy, tiny_tokenizer, SleepsForever, SPEC, max_turns=4, step_timeout=0.5)
    (ep,), _ = run_bounded(runner, ["slow"])
    assert ep.end == "timeout" and ep.reports[0]["error"].startswith("step: StepTimeout: no result within 0.5 s")
    assert cancelled.wait(5)  # the coroutine's finally ran: its thread ended instead of hanging for a minute


def test_an_async_steps_own_timeout_error_is_an_error_not_the_deadline(tiny_tokenizer):
    class OwnTimeout(h.EchoEnv):
        async def step(self, action_text):
            raise TimeoutError("the remote service did not answer")

    policy = ScriptedPolicy(tiny_tokenizer, {"x": ["first"]}, end_of_turn_id(tiny_tokenizer))
    runner = EpisodeRunner(policy, tiny_tokenizer, OwnTimeout, SPEC, max_turns=4, step_timeout=5)
    (ep,), _ = run_bounded(runner, ["x"])
    assert ep.end == "error" and "the remote service did not answer" in ep.reports[0]["error"]


def test_a_hanging_plain_tool_function_ends_its_episode_at_the_timeout(tiny_tokenizer):
    policy = ScriptedPolicy(tiny_tokenizer, {"sleep": ["hang(seconds=30)"], "sum": ["add(a=1, b=2)", "It is 3."]},
                            end_of_turn_id(tiny_tokenizer))
    runner = EpisodeRunner(policy, tiny_tokenizer, lambda: ToolEnvironment([h.add, h.hang]), SPEC, max_turns=4,
                           step_timeout=0.5)
    (hung, fine), _ = run_bounded(runner, ["Please sleep.", "Please sum 1 and 2."])
    assert hung.end == "timeout" and [r["status"] for r in hung.reports] == ["timeout"]
    assert fine.end == "done" and fine.turns == 2 and fine.tool_turns == 1


def test_a_hanging_reset_ends_its_episode_before_its_first_turn(tiny_tokenizer):
    policy = ScriptedPolicy(tiny_tokenizer, {"fine": ["one", "two"]}, end_of_turn_id(tiny_tokenizer))
    runner = EpisodeRunner(policy, tiny_tokenizer, HangingReset, SPEC, max_turns=4, step_timeout=0.5)
    (hung, fine), _ = run_bounded(runner, ["hang", "fine"])
    assert (hung.end, hung.prompt_length, hung.turns) == ("timeout", 0, 0)
    assert [(r["turn"], r["status"]) for r in hung.reports] == [(0, "timeout")]
    assert fine.end == "done"


@pytest.mark.parametrize("size, end", [(1000, "max_turns"), (1001, "oversized")])
def test_an_observation_over_the_byte_limit_ends_the_episode_unappended(tiny_tokenizer, size, end):
    Flood.size = size
    policy = ScriptedPolicy(tiny_tokenizer, {"flood": ["one", "two"]}, end_of_turn_id(tiny_tokenizer))
    runner = EpisodeRunner(policy, tiny_tokenizer, Flood, SPEC, max_turns=2, max_total_tokens=4096,
                           max_observation_bytes=1000)
    (ep,), _ = run_bounded(runner, ["flood"])
    assert ep.end == end and ep.turn_rewards == ([1.0, 1.0] if end == "max_turns" else [1.0])
    if end == "oversized":
        assert [r["status"] for r in ep.reports] == ["oversized"] and "1001 bytes" in ep.reports[0]["error"]
        assert len(ep.token_ids) == ep.prompt_length + len(policy.samples["flood"][0].response_ids)
    else:
        assert ep.reports == [] and sum(1 for m in ep.loss_mask if m == 0) > ep.prompt_length + 200


def episode_sample(i: int, end: str, turn_rewards: list[float], reports: list[dict]) -> RolloutSample:
    return RolloutSample(i, 0, [1, 2], [3, 4], [-0.1, -0.1], "stop", loss_mask=[1, 1],
                         episode={"reward": sum(turn_rewards), "turns": 1, "tool_turns": 0, "truncated": False,
                                  "end": end, "bad": end in ("error", "timeout", "oversized"),
                                  "turn_rewards": turn_rewards, "reports": reports})


def stage(tiny_tokenizer, policy: str) -> RewardStage:
    cfg = parse_config(["--env.name", "env.py:Env", "--rollout.n_samples", "2", "--env.on_bad_tool", policy])
    ctx = SimpleNamespace(cfg=cfg, tokenizer=tiny_tokenizer, print=print,
                          dist=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True))
    return RewardStage(ctx)


def scored_batch(tiny_tokenizer, policy: str, ends: list[str]):
    timeout = [{"turn": 2, "status": "timeout", "error": "step: StepTimeout: no result within 1 s"}]
    samples = [episode_sample(i, end, [0.0, 1.0] if end == "done" else [1.0], timeout if end == "timeout" else [])
               for i, end in enumerate(ends)]
    rows = [{"row_id": 10 + i} for i in range(len(ends))]
    return stage(tiny_tokenizer, policy)(RolloutBatch(samples=samples, rows=rows, weights_version=0), step=3)


def test_on_bad_tool_zero_trains_on_the_failed_episode_with_reward_0(tiny_tokenizer):
    scored = scored_batch(tiny_tokenizer, "zero", ["done", "timeout", "done", "done"])
    assert [s.episode["end"] for s in scored.samples] == ["done", "timeout", "done", "done"]
    assert scored.scores == [1.0, 0.0, 1.0, 1.0]  # the timed-out episode's partial reward 1.0 is not trained on
    m = scored.metrics
    assert (m["episode/bad_frac"], m["episode/tool_timeout_frac"], m["episode/tool_error_frac"]) == (0.25, 0.25, 0.25)
    assert m["episode/turn_reward_mean"] == pytest.approx(4 / 7) and m["reward/dropped"] == 0


def test_on_bad_tool_drop_leaves_the_failed_episode_out(tiny_tokenizer):
    scored = scored_batch(tiny_tokenizer, "drop", ["done", "timeout", "done", "done"])
    assert [s.prompt_index for s in scored.samples] == [0, 2, 3] and scored.scores == [1.0, 1.0, 1.0]
    assert scored.metrics["reward/dropped"] == 1 and scored.metrics["episode/bad_frac"] == 0.25
    with pytest.raises(BadToolError, match="every episode of this step failed in the environment"):
        scored_batch(tiny_tokenizer, "drop", ["timeout", "timeout"])


def test_on_bad_tool_fail_stops_with_one_line_naming_the_episode_and_the_settings(tiny_tokenizer):
    with pytest.raises(BadToolError) as caught:
        scored_batch(tiny_tokenizer, "fail", ["done", "timeout", "done", "done"])
    message = str(caught.value)
    assert isinstance(caught.value, UserInputError) and "\n" not in message  # cli.py prints it as one line
    assert re.search(r"episode 0 of prompt row 11 ended 'timeout' \(step: StepTimeout: no result within 1 s\)",
                     message)
    assert "--env.step_timeout" in message and "--env.on_bad_tool zero or drop" in message
    scored_batch(tiny_tokenizer, "fail", ["done", "done"])  # no failed episode: nothing raised


def test_reports_and_turn_rewards_reach_metrics_and_the_sample_log(tiny_model_path, tiny_tokenizer,
                                                                   arithmetic_store, dist_single, tmp_path):
    """Calculator episodes where "9 - 4" hangs its step and "6 * 7" raises (flaky_calculator.py), under
    env.step_timeout 1 and env.on_bad_tool zero: the run trains on, and each step's metrics and records say
    which episodes failed and how."""
    engine = ScriptedAnswers(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)
    args[args.index("--env.name") + 1] = FLAKY
    history = RLTrainer(parse_config([*args, "--env.step_timeout", "1", "--run.sample_log_every", "1",
                                      "--run.sample_log_k", "4"]), rollout=engine).train()
    records = read_samples(tmp_path / "run")
    assert len(history) == 2 and len(records) == 8
    seen = set()
    for step, m in enumerate(history, start=1):
        recs = [r for r in records if r["step"] == step]
        for rec in recs:
            end, reports = rec["episode_end"], rec["episode_reports"]
            if "9 - 4" in rec["prompt"]:
                assert end == "timeout" and [(r["turn"], r["status"]) for r in reports] == [(1, "timeout")]
                assert rec["turn_rewards"] == [] and rec["reward"] == 0.0
            elif "6 * 7" in rec["prompt"]:
                assert end == "error" and [r["status"] for r in reports] == ["error"]
                assert "the calculator's backend is down" in reports[0]["error"] and rec["reward"] == 0.0
            else:  # a calculator call (reward 0), then the scripted answer (1 when right)
                assert end == "done" and reports == [] and rec["turn_rewards"] == [0.0, rec["reward"]]
            seen.add(end)
        share = {e: sum(r["episode_end"] == e for r in recs) / len(recs) for e in ("timeout", "error")}
        assert m["episode/tool_timeout_frac"] == pytest.approx(share["timeout"])
        assert m["episode/bad_frac"] == pytest.approx(share["timeout"] + share["error"])
        assert m["episode/tool_error_frac"] == pytest.approx(share["timeout"] + share["error"])
        steps = [v for r in recs for v in r["turn_rewards"]]
        assert m["episode/turn_reward_mean"] == pytest.approx(sum(steps) / len(steps) if steps else 0.0)
    assert seen == {"timeout", "error", "done"}


def test_the_settings_are_in_help_and_a_wrong_value_is_one_line():
    text = help_text(Config())
    assert "--env.step_timeout 60.0" in text and "--env.on_bad_tool 'zero'" in text
    with pytest.raises(ConfigError, match="env.on_bad_tool"):
        parse_config(["--env.on_bad_tool", "ignore"])
    with pytest.raises(ConfigError, match="env.step_timeout"):
        parse_config(["--env.step_timeout", "-1"])


def test_each_steps_reward_sits_at_its_turns_last_token_and_the_rest_on_the_last():
    """Response: turn 1 (3 tokens), observation (2), turn 2 (2 tokens); step rewards 0.5 and 1.0, the score 2.0
    (0.5 more from a reward function): token rewards 0.5 at turn 1's end, 1.5 at the last token; REINFORCE++'s
    reward-to-go is 2.0 over turn 1 and 1.5 over turn 2. A failed episode's whole score stays on the last token."""
    rl = parse_config(["--rl.algo", "reinforce_pp"]).rl
    mask = [1, 1, 1, 0, 0, 1, 1]

    def sample(bad: bool) -> RolloutSample:
        return RolloutSample(0, 0, [1, 2], list(range(3, 10)), [-0.1] * 7, "stop", loss_mask=mask,
                             episode={"reward": 1.5, "turns": 2, "tool_turns": 1, "truncated": False,
                                      "end": "timeout" if bad else "done", "bad": bad, "turn_rewards": [0.5, 1.0],
                                      "reports": []})

    traj = with_advantages(pad_trajectory([sample(False), sample(True)], [2.0, 2.0], pad_id=0), rl, 0.0)
    rows = traj.token_rewards[:, 1:]  # response token j is predicted at position prompt_len - 1 + j = 1 + j
    assert rows[0].tolist() == [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.5]
    assert rows[1].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    returns = reinforce_pp_returns(traj.token_rewards, traj.action_mask)[:, 1:]
    assert returns[0].tolist() == [2.0, 2.0, 2.0, 0.0, 0.0, 1.5, 1.5]
    assert (traj.token_rewards * traj.action_mask).sum(1).tolist() == [2.0, 2.0]  # sequence estimators: the score
