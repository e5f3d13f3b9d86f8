"""The episode rollout mode of an RL run (`env.name`): a `RolloutService` whose batch is multi-turn episodes.

`EpisodeRolloutService.generate(rows, spec)` plays `spec.n` episodes per prompt row with the rollout engine
(`episode.py:EpisodeRunner`, token in / token out; each turn samples with `spec`, `n` = 1) and returns one
`RolloutSample` per episode, prompt-major as the single-turn mode does, so a prompt's `n` episodes are its GRPO
group:

- `prompt_ids`: the episode's first prompt (the environment's first user message, rendered by the chat template
  with the tools); `response_ids`: every token after it, generated turns and observation turns alike;
- `logprobs`: the rollout log-prob of each generated token, 0.0 on observation tokens;
- `loss_mask`: 1 on generated tokens, 0 on observation tokens (the trajectory multiplies its action mask by it, so
  the policy loss, the KL and the entropy read generated tokens only);
- `finish_reason`: "length" when a budget ended the episode (`env.max_turns`, `env.max_tokens`), else
  "stop" (so `rl.overlong_mask` drops truncated episodes' loss weight);
- `episode`: the environment's reward (the sum of its step rewards), each step's reward (`turn_rewards`), the
  episode's turns, tool-calling turns, truncation and end, whether the environment failed it (`bad`: a step
  raised, passed `env.step_timeout` or returned an oversized observation) and its `reports`, which the reward
  stage turns into the sample's reward (`env.on_bad_tool` for bad ones), the `episode/...` metrics and the sample
  log's record.

What the environment's `reset(row)` gets (`environment_row`): the store row's columns (`ground_truth`,
`data_source`, `row_id`, the extra fields kept by data prep) plus `prompt` (the question: the last user message of
a conversational prompt, else the stored prompt text, which is the question itself when the store was prepared
with `--no-apply_chat_template`) and `answer` (the ground truth), unless the extra fields already have them.

Held-out evaluation plays its episodes through `play(rows, spec)`, the same runner on the same engine.

The runner plays in lockstep rounds by default (`env.rounds lockstep`, `EpisodeRunner(lockstep=True)`): a
batch's episodes follow from the step's seed, the weights and the rows, not from how long the environment's steps
took, so a resumed run plays exactly the episodes an uninterrupted one would. `env.rounds continuous` starts
a round as soon as any step has ended (no barrier per turn: a slow tool holds back only its own episode), at the
price of that reproducibility.

Synchronous mode: the episodes are played in `generate` itself (`Pending.done`), in the step that trains on them.
Asynchronous mode (`rollout.async_generation`, one step off-policy as for single turns): `generate` hands the
batch to a background thread that plays it, driving the engine, while the trainer trains on the step before; the
service's collect (or `quiesce`, before a checkpoint or an evaluation) waits for it, and the engine gets new
weights only after that (`RolloutService`: syncs happen only after a collect). This holds for the HF engine and
for engines in their own process (`rollout.placement` sidecar / disaggregated); a colocated vLLM engine generates
in the caller's thread as its single-turn batches do (its `submit` generates at once), so its episodes are played
in `generate`, one step stale without overlap. Either way the engine's weights are those of `engine_version`
throughout a batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from ds_rlhf.agent.episode import Episode, EpisodeRunner
from ds_rlhf.data.convert import row_prompt_messages
from ds_rlhf.rollout.base import Pending, RolloutSample, SamplingSpec
from ds_rlhf.rollout.service import RolloutService


def environment_row(row: dict) -> dict:
    """The row an environment's `reset` gets for a prompt store row (module docstring)."""
    out = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in row.items() if k not in ("input_ids", "extra")}
    if row.get("extra"):
        extra = json.loads(row["extra"])
        out.update({k: v for k, v in extra.items() if k not in out})
    messages = row_prompt_messages(row)
    users = [m.get("content") for m in messages or [] if m.get("role") == "user"]
    question = users[-1] if users and isinstance(users[-1], str) else row.get("prompt_text")
    out.setdefault("prompt", question)
    out.setdefault("answer", row.get("ground_truth"))
    return out


def episode_sample(ep: Episode, prompt_index: int, sample_index: int) -> RolloutSample:
    """One finished episode as the trainer's `RolloutSample` (module docstring)."""
    p = ep.prompt_length
    return RolloutSample(prompt_index=prompt_index, sample_index=sample_index, prompt_ids=list(ep.token_ids[:p]),
                         response_ids=list(ep.token_ids[p:]), logprobs=list(ep.logprobs[p:]),
                         finish_reason="length" if ep.truncated else "stop", loss_mask=list(ep.loss_mask[p:]),
                         episode={"reward": ep.reward, "turns": ep.turns, "tool_turns": ep.tool_turns,
                                  "truncated": ep.truncated, "end": ep.end, "bad": ep.bad,
                                  "turn_rewards": [float(r) for r in ep.turn_rewards],
                                  "reports": [dict(r) for r in ep.reports]})


class EpisodeRolloutService(RolloutService):
    """`RolloutService` whose `generate` plays episodes (module docstring). `tokenizer`: the run's; `env_factory`:
    `environment.load_environment(...)`'s result; `max_turns` / `max_total_tokens`: each episode's budgets;
    `step_timeout`: seconds per environment call (`env.step_timeout`, 0 = none); `lockstep`: the runner's rounds
    (`env.rounds`: True = lockstep, False = continuous); everything else as `RolloutService`."""

    def __init__(self, *args, tokenizer, env_factory: Callable[[], Any], max_turns: int, max_total_tokens: int,
                 max_workers: int = 8, step_timeout: float = 0.0, lockstep: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer, self.env_factory = tokenizer, env_factory
        self.max_turns, self.max_total_tokens, self.max_workers = max_turns, max_total_tokens, max_workers
        self.step_timeout, self.lockstep = step_timeout, lockstep
        self.last_episodes: list[Episode] = []  # the last batch's episodes, prompt-major (for inspection)
        # async mode: the thread playing the next batch while the trainer trains (module docstring)
        self.background = self.asynchronous and (getattr(self.engine, "backend", "?") == "hf"
                                                 or getattr(self.engine, "placement", "colocated") != "colocated")
        self._player = cf.ThreadPoolExecutor(1, thread_name_prefix="ds_rlhf-episodes") if self.background else None

    def generate(self, rows: list[dict], spec: SamplingSpec) -> Pending:
        if self._player is not None:
            future = self._player.submit(self._timed_play, rows, spec)
            return Pending(lambda: self._finished(*future.result()))
        return Pending.done(self._finished(*self._timed_play(rows, spec)))

    def _timed_play(self, rows: list[dict], spec: SamplingSpec):
        start = time.perf_counter()
        episodes, samples = self._play(rows, spec)
        return episodes, samples, time.perf_counter() - start

    def _finished(self, episodes: list[Episode], samples: list[RolloutSample], seconds: float):
        self.last_episodes = episodes
        return samples, (seconds, sum(sum(s.loss_mask) for s in samples))

    def play(self, rows: list[dict], spec: SamplingSpec) -> list[RolloutSample]:
        """`spec.n` episodes per row on the engine as it is (awake, holding the weights to evaluate), as samples,
        prompt-major: held-out evaluation's `generate` (`rl_eval.evaluate`). Leaves `last_episodes` alone."""
        return self._play(rows, spec)[1]

    def _play(self, rows: list[dict], spec: SamplingSpec) -> tuple[list[Episode], list[RolloutSample]]:
        n = spec.n
        runner = EpisodeRunner(self.engine.generate, self.tokenizer, self.env_factory, dataclasses.replace(spec, n=1),
                               max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                               max_workers=self.max_workers, lockstep=self.lockstep, step_timeout=self.step_timeout)
        episodes = runner.run([r for r in (environment_row(row) for row in rows) for _ in range(n)])
        for ep in episodes:
            if ep.prompt_length == 0:  # the environment's reset raised or timed out: there is no prompt to train on
                error = next((r["error"] for r in ep.reports if r.get("turn") == 0), "no first message")
                raise RuntimeError(f"env.name: the environment could not start an episode for prompt row "
                                   f"{ep.index // n} ({error})")
        return episodes, [episode_sample(ep, ep.index // n, ep.index % n) for ep in episodes]
