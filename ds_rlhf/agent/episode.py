"""The episode runner: many multi-turn episodes against one policy, token in / token out.

An episode holds its token ids from the first prompt on. Each round, every episode waiting for the policy is sent
in ONE `generate(prompts, spec)` call (any `RolloutEngine.generate`; episodes at different turns share it). The
generated ids and their log-probs are appended exactly as returned; the decoded turn goes to the environment's
`step` in a thread (below); its observation turns are rendered by the chat template (`rendering.py`), tokenized and
appended after the generated ids. An episode whose step is still running does not hold back the others: a round
starts as soon as any step has finished, with every episode that is waiting then. With `lockstep=True` a round
starts when every step in flight has finished instead, its episodes in index order: which episodes share a generate
call, in which order and in which round (each round's seed differs) then follows from the episodes alone, not from
how long their steps took, so a batch of episodes is reproducible from its seed (what the RL loop needs to resume
exactly; a slow step holds back the whole round).

A turn ends at a stop token (the spec's, the tokenizer's EOS and end-of-turn token, and `</tool_call>` where the
tokenizer has it as one token) or at `spec.max_new_tokens`. An episode ends when the environment says done, or is
`truncated` at `max_turns` generated turns without done, or when its ids reach `max_total_tokens` (the turn that
reaches it is cut there and not stepped; an observation that would pass it is not appended).

Deadlines and bad steps: every `reset` and `step` call (sync or `async def`; a `ToolEnvironment`'s step runs
its plain tool functions inside it) runs in a worker thread of its own with a deadline of `step_timeout` seconds
(0 = none), counted from when the call starts. A call past it ends its episode ("timeout", with a report) and the
runner goes on without it: a Python thread cannot be killed, so the hung thread is abandoned (a daemon thread,
it stops counting against `max_workers` at the deadline and does not keep the process alive at exit) and whatever
it returns later is ignored. An `async def` reset or step is cancelled at the deadline instead (its `finally`
blocks run and its thread ends). A tool that must be stopped runs in a `Sandbox` process, which is killed at its
own timeout.
An observation turn larger than `max_observation_bytes` (UTF-8) is not tokenized or appended: the episode ends
("oversized", with a report). A step that raises ends its episode ("error"), except one whose reward is a bool or a
string (`BadRewardError`): that stops the runner. `BAD_ENDS` are these three ends;
the RL loop applies `env.on_bad_tool` to such episodes.

Output (`Episode`): `token_ids`; `loss_mask` (1 on generated tokens, 0 on prompt and observation tokens);
`logprobs` aligned with them (the rollout log-prob on generated tokens, 0.0 elsewhere); per-step rewards and their
sum; turn count; `truncated` and why; the environment's and the tools' problems as `reports`.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_rlhf.agent.environment import StepResult, StepTimeout, run_reset, run_step
from ds_rlhf.agent.rendering import ChatRenderer
from ds_rlhf.agent.sandbox import Sandbox
from ds_rlhf.errors import ConfigError, UserInputError
from ds_rlhf.rewards.calling import BadRewardError
from ds_rlhf.rollout.base import RolloutSample, SamplingSpec
from ds_rlhf.rollout.stops import stop_token_ids

GenerateFn = Callable[[list[list[int]], SamplingSpec], list[RolloutSample]]
TOOL_CALL_END = "</tool_call>"
BAD_ENDS = ("error", "timeout", "oversized")  # an environment step that raised, hung past the deadline, or flooded
# an observation turn larger than this ends its episode: four times the sandbox's per-call output cap (a sandboxed
# call's printed output and its value are each cut at `Sandbox.max_output_bytes`, so its turn stays under it)
MAX_OBSERVATION_BYTES = 4 * Sandbox.max_output_bytes


@dataclass
class Episode:
    index: int
    row: Any
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0  # generated turns
    tool_turns: int = 0  # steps that ran at least one tool call (a tool turn other than a malformed call's error)
    done: bool = False  # the environment ended it
    truncated: bool = False
    end: str = ""  # "done" | "max_turns" | "max_total_tokens" | "error" | "timeout" | "oversized"
    actions: list[str] = field(default_factory=list)  # each turn's decoded text
    observations: list[list[dict]] = field(default_factory=list)  # each step's turns, as rendered
    reports: list[dict] = field(default_factory=list)
    closed_by: str | None = field(default=None, repr=False)  # the stop token ending the last turn, as text

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def bad(self) -> bool:
        """The environment failed it: a step raised, hung past the deadline or returned an oversized turn."""
        return self.end in BAD_ENDS

    def _extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids.extend(int(t) for t in ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))

    def _finish(self, end: str) -> None:
        self.end, self.truncated = end, end in ("max_turns", "max_total_tokens")


class EpisodeRunner:
    """Runs episodes: `run(rows)` -> one `Episode` per row, in order.

    `env_factory()` makes one environment per episode (a class, `load_environment(...)`'s result, a lambda).
    `spec`: the sampling of every turn (`n` must be 1; a seed is shifted each round so rounds differ).
    `tools`: the tool specs shown in the prompt (default: the first environment's `specs`, as `ToolEnvironment`
    has). `max_workers`: environment resets and steps running at once. `lockstep`: rounds wait for every step in
    flight. `step_timeout`: seconds per reset / step call (0 = none); `max_observation_bytes`: the largest
    observation turn (module docstring)."""

    def __init__(self, generate: GenerateFn, tokenizer, env_factory: Callable[[], Any], spec: SamplingSpec, *,
                 max_turns: int = 4, max_total_tokens: int = 1024, max_workers: int = 8,
                 system_prompt: str | None = None, tools: list[dict] | None = None, lockstep: bool = False,
                 step_timeout: float = 0.0, max_observation_bytes: int = MAX_OBSERVATION_BYTES) -> None:
        if spec.n != 1:
            raise ConfigError(f"episodes generate one sample per turn: SamplingSpec.n must be 1, got {spec.n}")
        if max_turns < 1 or max_total_tokens < 1:
            raise ConfigError(f"max_turns ({max_turns}) and max_total_tokens ({max_total_tokens}) must be >= 1")
        self.generate, self.tokenizer, self.env_factory = generate, tokenizer, env_factory
        self.max_turns, self.max_total_tokens, self.max_workers = max_turns, max_total_tokens, max_workers
        self.system_prompt, self.tools, self.lockstep = system_prompt, tools, lockstep
        self.step_timeout, self.max_observation_bytes = float(step_timeout), int(max_observation_bytes)
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        extra = [added[TOOL_CALL_END]] if TOOL_CALL_END in added else []
        stops = tuple(dict.fromkeys([*spec.stop_token_ids, *stop_token_ids(tokenizer), *extra]))
        self.spec = dataclasses.replace(spec, stop_token_ids=stops)
        self.generate_calls: list[int] = []  # episodes per generate call, in order

    def run(self, rows: Sequence[Any]) -> list[Episode]:
        episodes = [Episode(i, row) for i, row in enumerate(rows)]
        envs = [self.env_factory() for _ in rows]
        tools = self.tools if self.tools is not None else getattr(envs[0], "specs", None) if envs else None
        renderer = ChatRenderer(self.tokenizer, system_prompt=self.system_prompt, tools=tools)
        calls = _Calls(self.max_workers, self.step_timeout)
        resets = [calls.submit(_safe_reset, env, row, self.step_timeout) for env, row in zip(envs, rows)]
        calls.wait(resets, every=True)
        waiting = []
        for ep, future in zip(episodes, resets):
            first = future.result()
            if isinstance(first, BaseException):
                status = "timeout" if isinstance(first, StepTimeout) else "error"
                ep.reports.append({"turn": 0, "status": status, "error": f"reset: {_describe(first)}"})
                ep._finish(status)
                continue
            ep._extend(renderer.prompt_ids(first), 0)
            ep.prompt_length = len(ep.token_ids)
            waiting.append(ep)
        stepping: dict[cf.Future, Episode] = {}
        rounds = 0
        while waiting or stepping:
            waiting = [ep for ep in waiting if self._has_room(ep)]
            if waiting:
                for ep, sample in zip(waiting, self._generate(waiting, rounds)):
                    if self._take_turn(ep, sample):
                        stepping[calls.submit(_safe_step, envs[ep.index], ep.actions[-1], self.step_timeout)] = ep
                rounds += 1
                waiting = []
            if stepping:
                finished = calls.wait(list(stepping), every=self.lockstep)
                for future in sorted(finished, key=lambda f: stepping[f].index):
                    ep = stepping.pop(future)
                    if self._after_step(ep, future.result(), renderer):
                        waiting.append(ep)
        return episodes

    def _has_room(self, ep: Episode) -> bool:
        if len(ep.token_ids) >= self.max_total_tokens:
            ep._finish("max_total_tokens")
            return False
        return True

    def _generate(self, waiting: list[Episode], rounds: int) -> list[RolloutSample]:
        room = max(self.max_total_tokens - len(ep.token_ids) for ep in waiting)
        seed = None if self.spec.seed is None else self.spec.seed + rounds * 1_000_003
        spec = dataclasses.replace(self.spec, max_new_tokens=min(self.spec.max_new_tokens, room), seed=seed)
        samples = self.generate([list(ep.token_ids) for ep in waiting], spec)
        self.generate_calls.append(len(waiting))
        if len(samples) != len(waiting):
            raise RuntimeError(f"generate returned {len(samples)} samples for {len(waiting)} prompts")
        return samples

    def _take_turn(self, ep: Episode, sample: RolloutSample) -> bool:
        """Append the generated ids; True when the environment should step on them."""
        ids, logprobs = list(sample.response_ids), list(sample.logprobs)
        if len(ids) != len(logprobs):
            raise RuntimeError(f"a sample has {len(ids)} tokens but {len(logprobs)} log-probs")
        room = self.max_total_tokens - len(ep.token_ids)
        cut = len(ids) > room
        ids, logprobs = ids[:room], logprobs[:room]
        ep._extend(ids, 1, logprobs)
        ep.turns += 1
        ep.actions.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        ep.closed_by = self.tokenizer.decode(ids[-1:]) if ids and ids[-1] in self.spec.stop_token_ids else None
        if cut or (len(ep.token_ids) >= self.max_total_tokens and ep.closed_by is None):
            ep._finish("max_total_tokens")
            return False
        return True

    def _after_step(self, ep: Episode, result: StepResult | BaseException, renderer: ChatRenderer) -> bool:
        """Record a finished step; True when the episode waits for the policy again."""
        turn = ep.turns
        if isinstance(result, BadRewardError):  # a reward of a type no reward has: the environment is wrong
            raise result
        if isinstance(result, BaseException):
            status = "timeout" if isinstance(result, StepTimeout) else "error"
            ep.reports.append({"turn": turn, "status": status, "error": f"step: {_describe(result)}"})
            ep._finish(status)
            return False
        ep.turn_rewards.append(result.reward)
        if any(m.get("role") == "tool" and m.get("name") != "error" for m in result.messages):
            ep.tool_turns += 1
        ep.reports.extend({"turn": turn, **r} for r in result.reports)
        if result.done:
            ep.done = True
            ep._finish("done")
            return False
        if ep.turns >= self.max_turns:
            ep._finish("max_turns")
            return False
        size = max((len(str(m.get("content", "")).encode("utf-8", "replace")) for m in result.messages), default=0)
        if size > self.max_observation_bytes:
            ep.reports.append({"turn": turn, "status": "oversized",
                               "error": f"step: an observation turn of {size} bytes, over the "
                                        f"{self.max_observation_bytes}-byte limit (not appended)"})
            ep._finish("oversized")
            return False
        turns = renderer.observation_turns(result.messages)
        ids = renderer.observation_ids(result.messages, ep.closed_by)
        if len(ep.token_ids) + len(ids) >= self.max_total_tokens:
            ep._finish("max_total_tokens")
            return False
        ep.observations.append(turns)
        ep._extend(ids, 0)
        return True


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class BadToolError(UserInputError):
    """An episode its environment failed, under `env.on_bad_tool fail` (one line: the episode, its report and what
    to change)."""


class _Calls:
    """Environment calls, each in a daemon thread of its own, at most `workers` running at once (the rest queue);
    a running call past `timeout` seconds (0 = none) gets `StepTimeout` as its result and frees its slot, its
    thread left to finish or hang on its own (its late result is dropped)."""

    def __init__(self, workers: int, timeout: float) -> None:
        self.workers, self.timeout = max(1, workers), timeout
        self.lock = threading.Lock()
        self.queued: list[tuple[cf.Future, Callable, tuple]] = []
        self.running: dict[cf.Future, float] = {}  # future -> when its call started

    def submit(self, fn: Callable, *args) -> cf.Future:
        future: cf.Future = cf.Future()
        with self.lock:
            self.queued.append((future, fn, args))
            self._start_queued()
        return future

    def _start_queued(self) -> None:  # under the lock
        while self.queued and len(self.running) < self.workers:
            future, fn, args = self.queued.pop(0)
            self.running[future] = time.monotonic()
            threading.Thread(target=self._run, args=(future, fn, args), daemon=True,
                             name="ds_rlhf-env").start()

    def _run(self, future: cf.Future, fn: Callable, args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001  the _safe_* functions catch Exception; this is the rest
            result = exc
        with self.lock:
            if self.running.pop(future, None) is not None:  # not timed out meanwhile
                future.set_result(result)
            self._start_queued()

    def _expire(self) -> float | None:
        """Time the overdue calls out; the seconds until the next deadline (None: no deadline)."""
        if self.timeout <= 0:
            return None
        now = time.monotonic()
        with self.lock:
            for future, started in list(self.running.items()):
                if now - started >= self.timeout:
                    del self.running[future]
                    future.set_result(StepTimeout(f"no result within {self.timeout:g} s (the call's thread is "
                                                  "abandoned; run a tool in a Sandbox to have it killed)"))
            self._start_queued()
            if not self.running:
                return None
            return max(0.0, min(self.running.values()) + self.timeout - now)

    def wait(self, futures: list[cf.Future], every: bool) -> set[cf.Future]:
        """The finished `futures` once one (every=False) or all of them (every=True) have finished or timed out."""
        until = cf.ALL_COMPLETED if every else cf.FIRST_COMPLETED
        while True:
            finished, pending = cf.wait(futures, timeout=self._expire(), return_when=until)
            if not pending or (finished and not every):
                return finished


def _safe_reset(env, row, timeout: float = 0.0):
    try:
        return run_reset(env, row, timeout)
    except Exception as exc:  # noqa: BLE001  one episode's failure is its report, not the runner's end
        return exc


def _safe_step(env, text: str, timeout: float = 0.0):
    try:
        return run_step(env, text, timeout)
    except Exception as exc:  # noqa: BLE001
        return exc


def run_episodes(generate: GenerateFn, tokenizer, env_factory: Callable[[], Any], rows: Sequence[Any],
                 spec: SamplingSpec, **kw) -> list[Episode]:
    """`EpisodeRunner(generate, tokenizer, env_factory, spec, **kw).run(rows)`."""
    return EpisodeRunner(generate, tokenizer, env_factory, spec, **kw).run(rows)
