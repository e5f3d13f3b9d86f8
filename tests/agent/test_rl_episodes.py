"""Multi-turn episodes in the RL loop (`env.name`): a GRPO run on the calculator environment with the tiny
model and the HF engine; the mask that reaches the loss is 0 exactly on observation tokens; the trained ids are the
ids the engine generated and the runner recorded."""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.recipes.rl import RLTrainer, make_trajectory
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.rollout.hf_engine import HFRolloutEngine
from ds_rlhf.telemetry.samples import read_samples

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = f"{ROOT / 'ds_rlhf' / 'agent' / 'examples' / 'calculator.py'}:CalculatorEnv"
QUESTIONS = [("What is 12 * 3?", 36), ("What is 7 + 5?", 12), ("What is 9 - 4?", 5), ("What is 6 * 7?", 42)]
EXPRESSION = re.compile(r"What is (\d+ [-+*] \d+)\?")


class FirstTurnCalls(HFRolloutEngine):
    """The tiny HF engine, except that each episode's first turn is a calculator call on the question's expression,
    teacher-forced: its log-probs are the model's own (`logprobs`), so the run trains on real tool-calling episodes
    although the random tiny model never writes one. Later turns are sampled. `returned`: every (prompt, sample)
    pair this engine handed out, in order."""

    def __init__(self, *args, tokenizer, **kwargs):
        super().__init__(*args, **kwargs)
        self.tok, self.eot = tokenizer, end_of_turn_id(tokenizer)
        self.returned: list[tuple[list[int], RolloutSample]] = []

    def generate(self, prompts, spec):
        samples = super().generate(prompts, spec)
        for i, prompt in enumerate(prompts):
            text = self.tok.decode(prompt)
            if text.count("<|im_start|>assistant") == 1:  # the episode's first turn
                ids = self.tok.encode(f'calculator("{EXPRESSION.search(text).group(1)}")',
                                      add_special_tokens=False) + [self.eot]
                logprobs = self.logprobs([list(prompt) + ids])[0][len(prompt) - 1:]
                samples[i] = RolloutSample(i, 0, list(prompt), ids, logprobs, "stop")
        self.returned += list(zip([list(p) for p in prompts], samples))
        return samples


class ScriptedAnswers(FirstTurnCalls):
    """`FirstTurnCalls`, and each episode's second turn teacher-forced too: `#### <answer>` (no tool call, so the
    calculator environment scores it and ends the episode) for the questions in `RIGHT`, `#### 0` for the others.
    `specs`: the sampling spec of every call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.specs: list = []

    def generate(self, prompts, spec):
        self.specs.append(spec)
        samples = super().generate(prompts, spec)
        for i, prompt in enumerate(prompts):
            text = self.tok.decode(prompt)
            if text.count("<|im_start|>assistant") == 2:  # the turn after the calculator's result
                expression = EXPRESSION.search(text).group(1)
                answer = ANSWERS[expression] if expression in RIGHT else 0
                ids = self.tok.encode(f"#### {answer}", add_special_tokens=False) + [self.eot]
                logprobs = self.logprobs([list(prompt) + ids])[0][len(prompt) - 1:]
                samples[i] = RolloutSample(i, 0, list(prompt), ids, logprobs, "stop")
                self.returned[len(self.returned) - len(prompts) + i] = (list(prompt), samples[i])
        return samples


ANSWERS = {EXPRESSION.search(q).group(1): a for q, a in QUESTIONS}
RIGHT = {"12 * 3", "7 + 5"}  # ScriptedAnswers answers these two of the four questions right


def episode_args(model, store, out, steps):
    return ["--model.path", str(model), "--data.train", str(store), "--run.output_dir", str(out),
            "--run.steps", str(steps), "--rl.algo", "grpo", "--env.name", CALCULATOR, "--env.max_turns", "3",
            "--rl.prompts_per_step", "2", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "12",
            "--rollout.max_model_len", "400", "--rollout.backend", "hf", "--optim.lr", "1e-3",
            "--optim.micro_batch_size", "4", "--run.progress", "false", "--run.tensorboard", "false",
            "--run.export_hf", "false"]


def make_engine(model, tokenizer):
    return FirstTurnCalls(str(model), dtype="float32", batch_size=8, tokenizer=tokenizer)


def test_grpo_on_calculator_episodes_logs_episode_metrics(tiny_model_path, tiny_tokenizer, arithmetic_store,
                                                           dist_single, tmp_path):
    engine = make_engine(tiny_model_path, tiny_tokenizer)
    history = RLTrainer(parse_config(episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)),
                        rollout=engine).train()
    assert len(history) == 2
    for h in history:
        # every first turn called the calculator, so each episode has >= 2 turns and tool calls in its turns
        assert 2 <= h["episode/turns_mean"] <= 3, h
        assert 1 / 3 <= h["episode/tool_call_rate"] <= 1, h
        assert 0 <= h["episode/truncated_frac"] <= 1 and h["episode/error_frac"] == 0, h
        assert h["reward/mean"] == pytest.approx(h["episode/reward_mean"])  # no reward.fn: the env's reward
        assert h["rollout/samples"] == 4 and "actor/loss" in h and "actor/entropy" in h
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "episode/turns_mean" in m] == [1, 2]


def test_loss_mask_is_zero_exactly_on_observations_and_trained_ids_are_the_generated_ones(
        tiny_model_path, tiny_tokenizer, arithmetic_store, dist_single, tmp_path):
    engine = make_engine(tiny_model_path, tiny_tokenizer)
    trainer = RLTrainer(parse_config(episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)),
                        rollout=engine)
    batch = trainer.service.batch(0)
    scored = trainer.parts.reward(batch, step=0)
    traj = make_trajectory(trainer.parts, trainer.ctx, scored, kl_coef=0.0, timer=trainer.timer)
    episodes = trainer.service.last_episodes
    assert len(episodes) == len(scored.samples) == len(traj) == 4
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids)
        # token in / token out: the trained row is the episode's ids, nothing decoded and re-encoded
        assert traj.input_ids[i, :n].tolist() == ep.token_ids
        assert int(traj.attention_mask[i].sum()) == n
        # the mask reaching the loss: position t scores token t+1, 1 exactly where the runner generated it
        mask = traj.action_mask[i].tolist()
        assert mask[: n - 1] == [float(m) for m in ep.loss_mask[1:]]
        assert not any(mask[n - 1:])
        observation = [t for t in range(ep.prompt_length, n) if ep.loss_mask[t] == 0]
        assert observation, "every episode here has a tool result between its turns"
        assert all(mask[t - 1] == 0.0 for t in observation)
        assert traj.rollout_logp[i, : n - 1].tolist() == pytest.approx(ep.logprobs[1:])
        # the ids trained on (mask 1) are, in order, exactly the ids the engine returned for this episode's turns
        trained = traj.input_ids[i, 1:n][traj.action_mask[i, : n - 1] > 0].tolist()
        # (each turn of an episode has its own prompt length; a group's episodes share their first turn)
        turns = {len(prompt): s.response_ids for prompt, s in engine.returned
                 if ep.token_ids[: len(prompt) + len(s.response_ids)] == prompt + s.response_ids}
        returned = [t for length in sorted(turns) for t in turns[length]]
        assert len(turns) == ep.turns
        assert trained == returned and len(returned) == sum(ep.loss_mask)
        assert ep.turns >= 2
    trainer.train()  # the run's step, then everything closed


@pytest.mark.parametrize("reward_fn", [None, "half"])
def test_held_out_evaluation_plays_greedy_episodes_scored_as_training(reward_fn, tiny_model_path, tiny_tokenizer,
                                                                      arithmetic_store, dist_single, tmp_path):
    engine = ScriptedAnswers(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)
    args += ["--data.eval", str(arithmetic_store), "--run.eval_before_train", "true", "--run.eval_every", "1"]
    if reward_fn:  # its score is added to the environment's, in training and in evaluation alike
        args += ["--reward.fn", f"{ROOT / 'tests' / 'agent' / 'agent_helpers.py'}:{reward_fn}",
                 "--reward.workers", "0"]
    history = RLTrainer(parse_config(args), rollout=engine).train()
    greedy = [spec for spec in engine.specs if spec.temperature == 0.0]
    assert greedy and all(spec.n == 1 for spec in greedy)  # the evaluation's turns, one episode per prompt
    added = 0.5 if reward_fn else 0.0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 1]
    for m in evals:
        # every episode: a calculator call, then the answer; two of the four answers are right
        assert m["eval/prompts"] == m["eval/samples"] == 4
        assert m["eval/pass@1"] == pytest.approx(0.5)  # the environment's correctness (threshold 1)
        assert m["eval/reward_mean"] == pytest.approx(0.5 + added)
        assert m["eval/episode/turns_mean"] == pytest.approx(2.0)
        assert m["eval/episode/tool_call_rate"] == pytest.approx(0.5)
        assert m["eval/episode/truncated_frac"] == 0.0 and m["eval/truncated_frac"] == 0.0
        if reward_fn:
            assert m["eval/reward/half"] == pytest.approx(0.5)
    assert history[0]["reward/mean"] == pytest.approx(0.5 + added)  # training scored the same episodes alike


def test_sample_log_holds_each_episodes_transcript_with_its_turns(tiny_model_path, tiny_tokenizer, arithmetic_store,
                                                                  dist_single, tmp_path):
    engine = ScriptedAnswers(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)
    RLTrainer(parse_config([*args, "--run.sample_log_every", "1", "--run.sample_log_k", "4"]), rollout=engine).train()
    records = read_samples(tmp_path / "run")
    assert len(records) == 4
    specials = tiny_tokenizer.all_special_tokens
    for rec in records:
        expression = EXPRESSION.search(rec["prompt"]).group(1)
        turns = rec["turns"]
        # a calculator call, the tool's result, the final answer: the turn boundaries of the loss mask
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"], turns
        assert turns[0]["text"] == f'calculator("{expression}")<|im_end|>'
        assert str(ANSWERS[expression]) in turns[1]["text"] and "<|im_start|>assistant" in turns[1]["text"]
        right = expression in RIGHT
        assert turns[2]["text"] == f"#### {ANSWERS[expression] if right else 0}<|im_end|>"
        joined = "".join(t["text"] for t in turns)
        for token in specials:
            joined = joined.replace(token, "")
        assert joined == rec["response"]  # the turns are the whole response, nothing left out
        assert rec["tool_calls"] == 1 and rec["truncated"] is False and rec["episode_end"] == "done"
        assert rec["episode_reward"] == rec["reward"] == float(right)


def test_ppo_on_episodes_runs_gae_over_the_generated_tokens_and_logs_the_critic(
        tiny_model_path, tiny_tokenizer, arithmetic_store, dist_single, tmp_path):
    """PPO (critic, GAE) on scripted two-turn episodes (a calculator call, its result, an answer): observation
    positions get no value, advantage or return; each row's returns are the textbook GAE over its chain of generated
    tokens alone; two steps train the critic and log its metrics."""
    engine = ScriptedAnswers(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)
    args[args.index("--rl.algo") + 1] = "ppo"
    cfg = parse_config([*args, "--optim.critic_lr", "1e-3"])
    trainer = RLTrainer(cfg, rollout=engine)
    assert trainer.parts.critic is not None
    scored = trainer.parts.reward(trainer.service.batch(0), step=0)
    traj = make_trajectory(trainer.parts, trainer.ctx, scored, kl_coef=0.0, timer=trainer.timer)
    assert sorted(traj.scores.tolist()) == [0.0, 0.0, 1.0, 1.0]  # two of the four questions answered right
    for i in range(len(traj)):
        p, n = int(traj.prompt_lens[i]), int(traj.seq_lens[i])
        acting = traj.action_mask[i].bool()
        observation = ~acting.clone()
        observation[: p - 1] = False
        observation[n - 1:] = False
        assert observation.any() and acting.any()  # each episode: turn, tool result, turn
        for name in ("values", "advantages", "returns", "token_rewards"):
            assert (getattr(traj, name)[i][observation] == 0).all(), name
        # GAE over the chain of generated tokens alone (the observation removed): dense, textbook, in float64
        values = traj.values[i][acting].double()
        rewards = traj.token_rewards[i][acting].double()
        assert rewards[-1] == traj.scores[i] and (rewards[:-1] == 0).all()  # the score on the last generated token
        expected, next_value, running = [], 0.0, 0.0
        for t in reversed(range(len(values))):
            running = float(rewards[t]) + cfg.rl.gamma * next_value - float(values[t]) + \
                cfg.rl.gamma * cfg.rl.lam * running
            next_value = float(values[t])
            expected.append(running + next_value)
        torch.testing.assert_close(traj.returns[i][acting].double(), torch.tensor(expected[::-1], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
        assert (traj.values[i][acting] != 0).all()  # the critic's own values, not zeros
    history = trainer.train()
    assert len(history) == 2
    for h in history:
        for key in ("critic/loss", "critic/value_mean", "critic/explained_var", "critic/vf_clip_frac", "actor/loss"):
            assert key in h and math.isfinite(float(h[key])), (key, h)
        assert h["critic/loss"] > 0 and 2 <= h["episode/turns_mean"] <= 3
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "critic/loss" in m] == [1, 2]


@pytest.mark.parametrize("extra, message", [
    (["--rl.dynamic_sampling", "true"], "rl.dynamic_sampling is not supported with episodes"),
    (["--env.max_tokens", "5000"], "env.max_tokens=5000 is longer than the rollout context"),
])
def test_what_episodes_cannot_run_with_is_refused_at_parse_time(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--env.name", "env.py:Env", "--rollout.n_samples", "2", *extra])


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_episodes_parse_with_critic_and_critic_free_estimators(algo):
    cfg = parse_config(["--env.name", "env.py:Env", "--rollout.n_samples", "2", "--rl.algo", algo])
    assert cfg.rl.algo == algo and cfg.env.name == "env.py:Env"


GATED = f"{Path(__file__).parent / 'gated_calculator.py'}:GatedCalculatorEnv"


def test_async_episodes_are_played_while_the_step_before_trains(tiny_model_path, tiny_tokenizer, arithmetic_store,
                                                                 dist_single, tmp_path):
    """rollout.async_generation with episodes: `batch(0)` returns step 0's episodes while step 1's are still being
    played in the background (held at their first step by the gated environment), so the trainer trains on step 0
    meanwhile; step 1 trains on them one step stale, with the weights they were played with."""
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)
    args[args.index("--env.name") + 1] = GATED
    trainer = RLTrainer(parse_config([*args, "--rollout.async_generation", "true", "--rl.mismatch", "tis"]),
                        rollout=make_engine(tiny_model_path, tiny_tokenizer))
    env, service = trainer.parts.environment, trainer.service
    env.GATE.clear()
    env.FREE, env.waiting, env.resets = 4, 0, itertools.count()  # step 0's 4 episodes run free, step 1's wait
    first: list = []
    caller = threading.Thread(target=lambda: first.append(service.batch(0)), daemon=True)
    caller.start()
    caller.join(120)
    try:
        assert first, "batch(0) did not return while step 1's episodes were held: they are not played in the background"
        assert first[0].weights_version == 0 and len(first[0].samples) == 4
        deadline = time.time() + 300
        while env.waiting == 0:  # step 1's episodes reach their first step, in the background
            assert time.time() < deadline
            time.sleep(0.05)
        assert service.in_flight is not None and service.in_flight.weights_version == 0
    finally:
        env.GATE.set()
    service.publish(1)  # async: nothing moves until the batch in flight is collected
    second = service.batch(1)
    assert second.weights_version == 0 and len(second.samples) == 4  # one step stale
    assert {r["row_id"] for r in second.rows}.isdisjoint({r["row_id"] for r in first[0].rows})
    assert all(s.episode["turns"] >= 2 for s in second.samples)
    assert [len(ep.token_ids) for ep in service.last_episodes] == [
        len(s.prompt_ids) + len(s.response_ids) for s in second.samples]


SLOW_FIRST = '''
import time
from ds_rlhf.agent.examples.calculator import CalculatorEnv

class SlowFirst(CalculatorEnv):
    """The calculator; the first episode built in this process takes 1.5 s over its first step."""
    built = 0

    def __init__(self):
        super().__init__()
        SlowFirst.built += 1
        self.slow = SlowFirst.built == 1

    def step(self, action_text):
        if self.slow:
            self.slow = False
            time.sleep(1.5)
        return super().step(action_text)
'''


@pytest.mark.parametrize("rounds", ["lockstep", "continuous"])
def test_episode_rounds_continuous_does_not_wait_for_a_slow_step(rounds, tiny_model_path, tiny_tokenizer,
                                                                 arithmetic_store, dist_single, tmp_path):
    env_file = tmp_path / "slow_first.py"
    env_file.write_text(SLOW_FIRST)

    class Recording(FirstTurnCalls):
        sizes: list[int] = []

        def generate(self, prompts, spec):
            self.sizes.append(len(prompts))
            return super().generate(prompts, spec)

    engine = Recording(str(tiny_model_path), dtype="float32", batch_size=8, tokenizer=tiny_tokenizer)
    argv = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)
    argv[argv.index("--env.name") + 1] = f"{env_file}:SlowFirst"
    history = RLTrainer(parse_config([*argv, "--env.rounds", rounds]), rollout=engine).train()
    assert len(history) == 1 and history[0]["episode/error_frac"] == 0
    # four episodes open with a calculator call; the slow one's step still runs when the fast ones' steps are done
    assert engine.sizes[0] == 4, engine.sizes
    if rounds == "lockstep":  # the second round waits for every step: all four episodes, in one call
        assert engine.sizes[1] == 4, engine.sizes
    else:  # the fast episodes go on without the slow one, which is generated for in a later call
        assert engine.sizes[1] < 4 and len(engine.sizes) >= 3, engine.sizes


TWO_TURNS = '''
class TwoTurns:
    """Every episode has two generated turns: the first answer gets a fixed observation back, the second ends it
    with a reward of the second turn's length (so the advantages are not all zero)."""

    def reset(self, row):
        self.turn = 0
        return row["prompt"]

    def step(self, action_text):
        self.turn += 1
        if self.turn == 1:
            return "Check your answer and give it again.", 0.0, False
        return "", min(len(action_text), 40) / 40, True
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_episodes_on_the_colocated_vllm_engine(mode, tiny_model_path, arithmetic_store, vllm_colocated, tmp_path):
    """Two-turn episodes generated by the in-process vLLM engine: the second turn continues from the first turn's
    ids and the observation's, and the trainer's log-probs of every generated token agree with vLLM's."""
    env_file = tmp_path / "two_turns.py"
    env_file.write_text(TWO_TURNS)
    argv = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 2)
    argv[argv.index("--env.name") + 1] = f"{env_file}:TwoTurns"
    argv[argv.index("--rollout.backend") + 1] = "vllm"
    argv += ["--rollout.async_generation", str(mode == "async").lower(), "--run.sample_log_every", "1"]
    history = RLTrainer(parse_config(argv), rollout=vllm_colocated).train()
    assert len(history) == 2
    for h in history:
        assert h["episode/turns_mean"] == 2 and h["episode/error_frac"] == 0, h
    # vLLM's and the trainer's log-probs of the generated tokens agree on a batch generated with the weights being
    # trained (every step synchronously; async, the first: later batches are one update behind)
    on_policy = history if mode == "sync" else history[:1]
    assert all(h["mismatch/kl_rollout_trainer"] < 1e-3 for h in on_policy), history
    samples = read_samples(tmp_path / "run")
    assert samples and all([t["role"] for t in s["turns"]][::2] == ["assistant", "assistant"] for s in samples)
