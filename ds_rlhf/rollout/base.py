"""The rollout interface the trainer talks to, independent of which engine generates.

Why an interface: generation is most of an RL step's time, so the fast path is vLLM, but CI laptops and machines
without vLLM still need to run the same loop (Hugging Face `generate` backend). The trainer only sees token ids in,
token ids + per-token log-probs out, plus the sleep/wake hooks it needs around training; new weights go through the
engine's transport (`RolloutEngine.weights`, a `WeightTransport`).

Conventions every backend follows (tests check them):
- `generate` returns `len(prompts) * spec.n` samples in prompt-major order (prompt 0's n samples first).
- `logprobs[i]` is the log-prob of `response_ids[i]` under the distribution it was sampled from: the logits divided
  by `temperature`, then top-k and top-p truncation, renormalised (vLLM's `processed_logprobs`; greedy decoding:
  the raw logits). With temperature 1, top_p 1 and top_k off that is the model's raw distribution. The trainer
  scores the same distribution (`policy_forward.sequence_logprobs(temperature=..., top_p=..., top_k=...)`: the
  kept set recomputed from its logits with vLLM's rule, `algos/truncation.py`), so the mismatch ratio
  pi_trainer / pi_rollout is 1 where the weights agree and `mismatch/kl_rollout_trainer` goes to 0.
- `score` returns raw log-probs (no temperature: prompt log-probs skip the sampling processors), which the sync
  canary compares with the trainer's plain forward.
- With `spec.seed = s` and `spec.seeding = "request"`, prompt i's sample j is drawn with seed `s + i * n + j`:
  reproducible runs whatever the batch holds, yet distinct samples across prompts (one shared seed would give every
  identical prompt the same sample stream). `spec.seeding = "batch"` seeds the whole call once instead (vLLM: its
  workers' generators are reseeded and the prefix cache emptied before the call, then one kernel draws every
  request's noise): the same call (prompts, specs, engine options) gives the same samples whatever ran before, so
  a resumed run matches an uninterrupted one; but a prompt's samples depend on the rest of the call, every rank's
  groups included where one engine serves several ranks. vLLM's sampler loops over seeded requests one by one on
  the host at every decode step, so "request" costs decode throughput (docs/PERFORMANCE.md, "Rollout options").
  Backends without that cost (HF generate) treat both alike. RL runs default to "batch" (`rollout.seeding`).
- Responses stop at `stop_token_ids` and, unless `ignore_eos`, at the model's EOS (every id of its generation
  config's `eos_token_id`): the first stop token is the last token of `response_ids` (nothing after it), carries
  its log-prob like any other token, and `finish_reason` is "stop"; a response that reached `max_new_tokens`
  without one has `finish_reason` "length". RL rollouts and evaluation pass `rollout/stops.py:stop_token_ids`
  (the tokenizer's EOS, the generation config's EOS ids and the chat template's end-of-turn token).
"""

from __future__ import annotations

import numbers
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

SEEDINGS = ("request", "batch")


@dataclass
class SamplingSpec:
    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    seeding: str = "request"  # "request": a seed per request; "batch": one seed for the whole call (see above)

    def __post_init__(self):
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise ValueError(f"SamplingSpec.stop_token_ids must be token ids, got {stops!r}")
        self.stop_token_ids = tuple(int(t) for t in stops)
        if self.seeding not in SEEDINGS:
            raise ValueError(f"SamplingSpec.seeding must be one of {SEEDINGS}, got {self.seeding!r}")

    def request_seed(self, prompt_index: int) -> int | None:
        """Seed of prompt `prompt_index`'s first sample; sample j uses this + j (vLLM does the same for n > 1)."""
        return None if self.seed is None else self.seed + prompt_index * self.n


def batch_seed(specs) -> int | None:
    """The one seed of a vLLM call whose specs all use `seeding="batch"` (mixed from every group's seed, so two
    calls with different groups differ), else None (per-request seeds, or no seed at all)."""
    specs = list(specs)
    if not specs or any(s.seeding != "batch" or s.seed is None for s in specs):
        return None
    mixed = 0
    for s in specs:
        mixed = (mixed * 1_000_003 + s.seed) % (2**63 - 1)
    return mixed


@dataclass
class RolloutSample:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # Multi-turn episodes (`agent/rollout.py`): 1 on the response tokens the policy generated, 0 on the
    # observation tokens between its turns (trained on: none); None = every response token was generated.
    loss_mask: list[int] | None = None
    # the episode's outcome ({"reward", "turns", "tool_turns", "truncated", "end"}), or None for a single turn
    episode: dict | None = None
    # trainer updates applied to the weights that generated it (a sample continued across weight syncs: the oldest);
    # set by the rollout service (`service.py`), None until then
    weights_version: int | None = None


@dataclass(frozen=True)
class RolloutBatch:
    """What the rollout engine generated for one step's prompts, and with which weights (`service.py`'s
    `RolloutService.batch` makes them; the recipe's stages read them)."""

    rows: list[dict]  # the step's prompt rows (the store's columns: input_ids, ground_truth, ...)
    samples: list[RolloutSample]
    weights_version: int  # trainer steps applied to the weights that generated it (0 = the initial weights; the
    # oldest of its samples' `RolloutSample.weights_version` where they differ)
    # the engine's (seconds, response tokens) for the call(s) that made it; None: unknown (restored from a checkpoint)
    generation: tuple[float, int] | None = None


class TensorMeta(NamedTuple):
    """What a receiver must know about one tensor of a bucket before the bytes arrive."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


BucketPlan = list[list[TensorMeta]]


class RolloutError(RuntimeError):
    """A rollout engine could not do what was asked; the message says what to change."""


class Pending:
    """What a `*_later` call returns: `result()` waits for the engine's answer (raising its error) and returns it,
    the same on every call. Engines that answer at once return `Pending.done(value)`."""

    def __init__(self, read: Callable[[], object]) -> None:
        self._read, self._state = read, None

    @classmethod
    def done(cls, value=None) -> Pending:
        out = cls(lambda: value)
        out._state = ("ok", value)
        return out

    @property
    def ready(self) -> bool:
        """True once the answer was read (by `result()`, or given to `done` / `fill`): `result()` then waits for
        nothing."""
        return self._state is not None

    def fill(self, state: tuple[str, object]) -> None:
        """Give this reply its answer, read by someone else: `("ok", value)` or `("error", exception)`."""
        self._state = state

    def result(self):
        if self._state is None:
            try:
                self._state = ("ok", self._read())
            except Exception as e:  # noqa: BLE001  kept, then raised on this and every later call
                self._state = ("error", e)
        status, value = self._state
        if status == "error":
            raise value
        return value


@dataclass
class _Counters:
    generate_calls: int = 0
    generated_tokens: int = 0
    samples: int = 0
    generate_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class RolloutTicket:
    """A generation in flight (`RolloutEngine.submit`): finished (`samples`) or still running in the engine's
    process (`pending` holds what the engine needs to collect it)."""

    samples: list[RolloutSample] | None = None
    pending: object = None
    started: float = 0.0


class WeightTransport(ABC):
    """How new weights reach one rollout engine (`RolloutEngine.weights`), and what it counts of them. `WeightSync`
    hands it each sync's buckets; in-process engines load them (`InProcessWeights`), a server's client moves them
    to its process (`rollout/server/transports.py`, one class per transport)."""

    dtype: torch.dtype | None = None  # what the engine holds weights in; senders cast to it (None: no cast)

    def __init__(self) -> None:
        self.updates, self.bytes, self.seconds = 0, 0, 0.0

    @abstractmethod
    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], plan: BucketPlan | None = None, *,
             wait: bool = True) -> Pending:
        """Load a stream of (Hugging Face name, full tensor) buckets into the engine; `plan` (their names, shapes
        and dtypes) goes up front where the bytes travel elsewhere, one control message per sync. With
        `wait=False` it may return once the bytes are handed over, before the engine loaded them (a server in its
        own process, one training rank): the returned `Pending` reads the engine's acknowledgement and raises its
        error. The engine runs its commands in order, so a generation submitted after this call uses the new
        weights; the caller must not trust (train on) that generation before `result()` returned. The engine's
        prefix cache is dropped once the buckets are loaded (its KV was computed with the old weights)."""

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs now, as one bucket; names the engine does not know raise."""
        self.send([list(named_tensors)]).result()

    @property
    def lora_enabled(self) -> bool:
        """True when the engine serves the base plus a LoRA adapter that `load_adapter` replaces (adapter sync)."""
        return False

    def load_adapter(self, path: str) -> int:
        """Serve the peft adapter directory `path` from now on; returns the engine's id for it (new on every call,
        so the engine never serves a cached older adapter, whichever `WeightSync` calls)."""
        raise RolloutError(f"{type(self).__name__} has no LoRA adapter support: rollout.lora_sync=adapter needs the "
                           "colocated vLLM engine started with LoRA (make_rollout_engine(..., lora={'rank': r}))")

    def record(self, nbytes: int, seconds: float) -> None:
        """Count one update the engine loaded."""
        self.updates += 1
        self.bytes += nbytes
        self.seconds += seconds

    def stats(self) -> dict:
        return {"weight_updates": self.updates, "weight_bytes": self.bytes, "weight_seconds": self.seconds}

    def close(self) -> None:  # noqa: B027  optional hook: a transport without buffers or groups holds nothing
        """Release the transport's buffers and groups; idempotent."""


class InProcessWeights(WeightTransport):
    """Weights into an engine in this process: each bucket loaded by `load_bucket` (a list of (name, tensor)
    pairs; unknown names raise), counted as one update, then `reset_cache` drops the prefix cache."""

    def __init__(self, load_bucket: Callable[[list[tuple[str, torch.Tensor]]], None], dtype: torch.dtype | None,
                 reset_cache: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.load_bucket, self.dtype, self.reset_cache = load_bucket, dtype, reset_cache

    def send(self, buckets, plan=None, *, wait=True) -> Pending:
        for bucket in buckets:
            bucket = list(bucket)
            t0 = time.perf_counter()
            self.load_bucket(bucket)
            self.record(sum(t.numel() * t.element_size() for _, t in bucket), time.perf_counter() - t0)
        if self.reset_cache is not None:
            self.reset_cache()
        return Pending.done()


class RolloutEngine(ABC):
    """Generates rollouts; its `weights` transport accepts new weights. Subclasses: vLLM (colocated /
    disaggregated) and HF."""

    backend: str = "?"
    placement: str = "colocated"

    def __init__(self) -> None:
        self._c = _Counters()
        self.sleeping = False
        self.weights: WeightTransport | None = None  # how new weights reach this engine (set by each engine)

    @abstractmethod
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        """`len(prompts) * spec.n` samples, prompt-major; see the module docstring for the conventions."""

    def submit(self, prompts: list[list[int]], spec: SamplingSpec) -> RolloutTicket:
        """Start generating and return at once where the engine runs elsewhere (its own process), so the caller
        can train meanwhile; `collect(ticket)` returns the samples. In-process engines generate here, now. Only one
        ticket may be outstanding, and no other call (sync, score, sleep) may be made until it is collected."""
        return RolloutTicket(samples=self.generate(prompts, spec))

    def collect(self, ticket: RolloutTicket) -> list[RolloutSample]:
        if ticket.samples is None:
            raise RolloutError(f"{type(self).__name__} cannot collect a ticket it did not finish")
        return ticket.samples

    @abstractmethod
    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each `tokens[1:]` given its prefix, under the rollout engine's current weights."""

    def logprobs_replicas(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """`score` on every replica that serves generations (one list per replica): the sync canary checks each,
        so a replica that missed a sync cannot hide behind one that did not. One replica here."""
        return [self.logprobs(sequences)]

    @property
    def defers_replies(self) -> bool:
        """True where `weights.send(wait=False)` / `logprobs_replicas_later` really return before the engine has
        answered (a server in its own process, one training rank); False: they finish at once, as here."""
        return False

    def logprobs_replicas_later(self, sequences: list[list[int]]) -> Pending:
        """`logprobs_replicas` without waiting where the engine runs elsewhere (the sync canary then overlaps the next
        generation); `result()` returns its lists. Here: scored now."""
        return Pending.done(self.logprobs_replicas(sequences))

    def sleep(self) -> None:
        """Free accelerator memory (weights and KV cache) while the trainer runs; no-op where unsupported."""
        self.sleeping = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate memory: `("weights",)` first (then sync), `("kv_cache",)` last; None wakes everything."""
        if tags is None or "kv_cache" in tags:
            self.sleeping = False

    def record_generate(self, samples: list[RolloutSample], seconds: float, call_tokens: int | None = None) -> None:
        """Count this rank's `samples`; `seconds` and `call_tokens` are the engine call's (a call shared by several
        ranks, tensor-parallel or a server, generated every rank's tokens in those seconds; default: ours)."""
        tokens = sum(len(s.response_ids) for s in samples)
        call_tokens = tokens if call_tokens is None else call_tokens
        self._c.generate_calls += 1
        self._c.samples += len(samples)
        self._c.generated_tokens += tokens
        self._c.generate_seconds += seconds
        self._c.extra["last_generate"] = (seconds, call_tokens)
        self._c.extra["last_generate_tokens_per_s"] = call_tokens / seconds if seconds > 0 else float("nan")

    def last_generate(self) -> tuple[float, int] | None:
        """(seconds, response tokens) of the engine's last generate call: its own time (a remote engine: the
        server's, not the trainer's wait) and every token that call generated (all ranks' when it served several),
        or None before any; a local read, no call to the engine."""
        return self._c.extra.get("last_generate")

    def stats(self) -> dict:
        c = self._c
        return {
            "backend": self.backend, "placement": self.placement, "sleeping": self.sleeping,
            "generate_calls": c.generate_calls, "samples": c.samples, "generated_tokens": c.generated_tokens,
            "generate_seconds": c.generate_seconds,
            "tokens_per_s": c.generated_tokens / c.generate_seconds if c.generate_seconds > 0 else float("nan"),
            **(self.weights.stats() if self.weights is not None else {}), **c.extra,
        }

    def close(self) -> None:  # noqa: B027  optional hook
        """Release the engine; idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def finish_reason_of(response_ids: Sequence[int], stop_ids: Iterable[int], max_new_tokens: int) -> str:
    """'stop' when the last token is a stop token, else 'length' (shared by backends that decode themselves)."""
    stops = set(stop_ids)
    if response_ids and response_ids[-1] in stops:
        return "stop"
    return "length" if len(response_ids) >= max_new_tokens else "stop"
