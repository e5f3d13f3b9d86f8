"""Sampled held-out evaluation of episodes: k > 1 episodes per prompt (`eval.greedy false`, `eval.samples`),
played by the episode service on the prompt store's rows and scored by the environment, give pass@k and mean@k
over episodes equal to the values computed by hand from which episodes the environment scored 1."""

from __future__ import annotations

import pytest

from ds_rlhf.agent.rollout import EpisodeRolloutService
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.recipes.rl_eval import evaluate, load_eval_rows
from ds_rlhf.rollout.base import RolloutSample, SamplingSpec
from tests.agent.test_rl_episodes import QUESTIONS

N = 4
# which of a question's N episodes (by sample index) answer right: 0, 1, 2 and 4 of 4
RIGHT = {"What is 12 * 3?": [], "What is 7 + 5?": [2], "What is 9 - 4?": [0, 3], "What is 6 * 7?": [0, 1, 2, 3]}
ANSWER = dict(QUESTIONS)


class CheckEnv:
    """Two turns: any first turn gets "Your final answer?"; the second is scored 1 when it is the row's answer."""

    def reset(self, row):
        self.answer = str(row["answer"])
        return row["prompt"]

    def step(self, action_text):
        if not hasattr(self, "asked"):
            self.asked = True
            return "Your final answer?", 0.0, False
        return "", float(action_text.strip() == self.answer), True


class SampledScript:
    """A rollout engine answering from a script: a question's episodes come prompt-major, in index order, in each
    lockstep round, so the one at position i of a call is sample i % N of its question. Records the request seed
    of every (question, sample, turn)."""

    backend = "hf"

    def __init__(self, tokenizer):
        self.tok, self.eot = tokenizer, end_of_turn_id(tokenizer)
        self.seeds: dict[tuple[str, int, int], int | None] = {}
        self.specs: list[SamplingSpec] = []

    def wake(self):
        pass

    def sleep(self):
        pass

    def generate(self, prompts, spec):
        self.specs.append(spec)
        out = []
        for i, prompt in enumerate(prompts):
            text = self.tok.decode(prompt)
            question = next(q for q in RIGHT if q in text)
            sample, turn = i % N, text.count("<|im_start|>assistant") - 1
            self.seeds[(question, sample, turn)] = spec.request_seed(i)
            reply = "Thinking." if turn == 0 else str(ANSWER[question] if sample in RIGHT[question] else -1)
            ids = self.tok.encode(reply, add_special_tokens=False) + [self.eot]
            out.append(RolloutSample(i, 0, list(prompt), ids, [-0.5] * len(ids), "stop"))
        return out


def test_sampled_evaluation_reports_pass_at_k_over_episodes(tiny_tokenizer, arithmetic_store):
    engine = SampledScript(tiny_tokenizer)
    service = EpisodeRolloutService(engine, None, prompts=list, spec=lambda step: None, total_steps=1,
                                    tokenizer=tiny_tokenizer, env_factory=CheckEnv, max_turns=3, max_total_tokens=400)
    rows = load_eval_rows(arithmetic_store, tiny_tokenizer)
    assert sorted(r["prompt_text"] for r in rows) == sorted(RIGHT)

    def environment_reward(samples, fn_scores):  # the environment's reward alone (no reward function, no model)
        return [s.episode["reward"] for s in samples], None

    metrics = evaluate(engine, rows, tokenizer=tiny_tokenizer, reward_fn=None, samples_per_prompt=N, greedy=False,
                       temperature=1.0, seed=11, k_values=(1, 2, 4), max_new_tokens=16, generate=service.play,
                       episode_scores=environment_reward)

    # by hand, c correct of n = 4 per question: pass@k = 1 - C(4 - c, k) / C(4, k)
    # c = 0, 1, 2, 4 -> pass@1 = (0 + 1/4 + 2/4 + 1) / 4; pass@2 = (0 + 1/2 + 5/6 + 1) / 4; pass@4 = (0 + 1 + 1 + 1) / 4
    assert metrics["eval/prompts"] == 4 and metrics["eval/samples"] == 16
    assert metrics["eval/pass@1"] == pytest.approx(7 / 16)
    assert metrics["eval/pass@2"] == pytest.approx((0 + 1 / 2 + 5 / 6 + 1) / 4)
    assert metrics["eval/pass@4"] == pytest.approx(3 / 4)
    # mean@k: the mean reward of each question's first k episodes (by sample index)
    assert metrics["eval/mean@2"] == pytest.approx((0 + 0 + 1 / 2 + 1) / 4)
    assert metrics["eval/reward_mean"] == pytest.approx(7 / 16)
    assert metrics["eval/episode/turns_mean"] == pytest.approx(2.0)
    # each turn is sampled (temperature > 0), and a question's episodes are distinct requests: distinct seeds
    assert engine.specs and all(spec.temperature == 1.0 and spec.n == 1 for spec in engine.specs)
    for question in RIGHT:
        for turn in (0, 1):
            seeds = [engine.seeds[(question, s, turn)] for s in range(N)]
            assert None not in seeds and len(set(seeds)) == N
