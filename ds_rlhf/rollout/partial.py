"""Partial rollouts (`rollout.partial_tokens`): no rollout waits for its longest samples.

With completions that end at EOS, a batch's lengths spread widely: most samples finish early and the engine then
decodes the few long ones at a tiny batch size while the step waits (`rollout/tail_decode_frac` measures that
share). `PartialRolloutService` caps every generate call at `chunk` new tokens per sample. A sample that neither
stopped nor reached `max_new_tokens` is carried over: the next step's call continues it (its prompt plus the tokens
it has, exact token ids, no re-tokenisation) beside the new prompts' samples, with the weights the engine holds
then. A prompt's group is handed to training once all its `n` samples finished, so a step trains on the groups that
completed in its call: those of new prompts whose samples all ended within `chunk` tokens, and carried ones.

- **Staleness bound.** A sample gets at most `chunk` tokens per call and ends by `max_new_tokens`, so its tokens come
  from at most `ceil(max_new_tokens / chunk)` consecutive weight versions (`max_versions`); each sample's
  `weights_version` is the version its group was started with (its oldest tokens'), so one batch mixes versions;
  the batch's `weights_version` is the oldest (`rollout/staleness` counts from it, `rollout/staleness_mean` from
  each sample's).
  Every token's log-prob is the one the engine sampled it with, so the mismatch correction (`rl.mismatch tis|mis`)
  weighs each token against the weights that actually generated it.
- **Batch size.** Each step draws `rl.prompts_per_step` new prompts; the number of groups it trains on varies
  around that (fewer in the first steps, while the carried pool fills up). A call that would complete no group at
  all continues the carried samples once more (without new prompts) until one completes.
- **Order and seeds.** A call's requests are the open groups' unfinished samples, oldest group first, then the new
  prompts' samples, one request each (`n=1`), seeded like any call (`spec.seed`, `spec.seeding`), so a run and its
  resume send the same calls.
- **Checkpoints.** `state_dict()` holds the open groups (rows, the tokens and log-probs so far, versions) beside the
  batch in flight, so a resumed run continues exactly the samples the interrupted one would have.

`rollout.partial_tokens` > 0 turns it on (synchronous or async generation; not with dynamic sampling or episodes:
`RolloutConfig` refuses those).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ds_rlhf.rollout.base import Pending, RolloutSample, SamplingSpec
from ds_rlhf.rollout.service import Generated, RolloutService, plain_row


@dataclass
class _Slot:
    """One sample of a group: the tokens and log-probs so far; `finish` is None while it is unfinished."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class _Group:
    """A prompt's `n` samples, started with the weights of `version`."""

    row: dict
    version: int
    slots: list[_Slot]

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.slots)


def max_versions(max_new_tokens: int, chunk: int) -> int:
    """The most weight versions one sample's tokens can come from: one per call, `chunk` tokens a call."""
    return math.ceil(max_new_tokens / chunk)


class PartialRolloutService(RolloutService):
    """`RolloutService` whose generate calls stop at `chunk` new tokens per sample and carry unfinished samples
    into the next call (module docstring). Same calls and the same guarantees about syncs as the base service."""

    def __init__(self, *args, chunk: int, **kwargs):
        super().__init__(*args, **kwargs)
        if chunk < 1:
            raise ValueError(f"PartialRolloutService: chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self.open: list[_Group] = []  # groups with an unfinished sample, oldest first

    def generate(self, rows: list[dict], spec: SamplingSpec) -> Pending:
        self.open += [_Group(dict(r), self.engine_version, [_Slot() for _ in range(spec.n)]) for r in rows]
        first = self._call(spec)

        def read() -> Generated:
            seconds, tokens = self._merge(*first.result(), spec)
            rounds = 1
            while self.open and not any(g.complete for g in self.open):  # nothing to train on: continue them
                more_seconds, more_tokens = self._merge(*self._call(spec, rounds=rounds).result(), spec)
                seconds, tokens, rounds = seconds + more_seconds, tokens + more_tokens, rounds + 1
            return self._take_complete((seconds, tokens))

        return Pending(read)

    def metrics(self) -> dict:
        """`rollout/open_groups`: groups carried into the next call; `rollout/carried_samples`: their unfinished
        samples."""
        return {"rollout/open_groups": len(self.open),
                "rollout/carried_samples": sum(s.finish is None for g in self.open for s in g.slots)}

    # ---- inside ----------------------------------------------------------------------------------------------
    def _requests(self) -> list[tuple[_Slot, list[int]]]:
        return [(slot, list(g.row["input_ids"]) + slot.response_ids)
                for g in self.open for slot in g.slots if slot.finish is None]

    def _call(self, spec: SamplingSpec, rounds: int = 0) -> Pending:
        """One engine call for every unfinished sample, `chunk` new tokens at most; `result()` is the requests'
        slots, the samples and the engine's (seconds, tokens)."""
        requests = self._requests()
        seed = None if spec.seed is None else spec.seed + rounds * 1_000_003  # an extra round's seeds differ
        call = dataclasses.replace(spec, n=1, max_new_tokens=min(self.chunk, spec.max_new_tokens), seed=seed)
        ticket = self.engine.submit([p for _, p in requests], call)
        slots = [s for s, _ in requests]
        if ticket.samples is not None:
            return Pending.done((slots, ticket.samples, self.engine.last_generate()))
        return Pending(lambda: (slots, self.engine.collect(ticket), self.engine.last_generate()))

    @staticmethod
    def _merge(slots: list[_Slot], samples: list[RolloutSample], generation, spec: SamplingSpec) -> tuple:
        """Append each call's tokens to its sample; a sample is finished at a stop or at `max_new_tokens` (tokens
        past it are dropped: the last call asked for up to `chunk`)."""
        for slot, s in zip(slots, samples, strict=True):
            slot.response_ids += s.response_ids
            slot.logprobs += s.logprobs
            over = len(slot.response_ids) - spec.max_new_tokens
            if s.finish_reason == "stop" and over <= 0:
                slot.finish = "stop"
            elif over >= 0:
                del slot.response_ids[spec.max_new_tokens:], slot.logprobs[spec.max_new_tokens:]
                slot.finish = "length"
        return generation or (0.0, 0)

    def _take_complete(self, generation) -> Generated:
        """The groups all of whose samples finished, as a batch (prompt-major, in the order they were started);
        the rest stay open."""
        done = [g for g in self.open if g.complete]
        self.open = [g for g in self.open if not g.complete]
        samples = [RolloutSample(i, j, list(g.row["input_ids"]), slot.response_ids, slot.logprobs, slot.finish,
                                 weights_version=g.version)
                   for i, g in enumerate(done) for j, slot in enumerate(g.slots)]
        return Generated(samples, generation, rows=[g.row for g in done],
                         weights_version=min((g.version for g in done), default=self.engine_version))

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["partial_groups"] = [{"row": plain_row(g.row), "version": g.version,
                                    "slots": [[list(s.response_ids), list(s.logprobs), s.finish] for s in g.slots]}
                                   for g in self.open]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.open = [_Group(dict(g["row"]), int(g["version"]), [_Slot(list(r), list(lp), f) for r, lp, f in g["slots"]])
                     for g in state.get("partial_groups", [])]
