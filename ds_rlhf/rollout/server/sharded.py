"""Several sidecar vLLM engines on the trainer's GPU, the rollout batch split between them (`rollout.sidecar_engines`).

Why: at RL batch sizes vLLM's decode is bound by its per-step host work (scheduling, sampler bookkeeping, output
processing: Python loops over the running requests, one thread per engine), not by the GPU. N engine processes with
1/N of the requests each run N of those loops at once on other CPU cores while they share the GPU
(docs/PERFORMANCE.md, "Several vLLM engines on one GPU").

`ShardedRolloutEngine(engines)` is one `RolloutEngine` over N `RemoteVLLMEngine`s (one training rank):
- `generate` / `submit`: the prompts are cut into N contiguous shards (sizes differing by at most one; fewer shards
  when there are fewer prompts); shard k starts at prompt o_k and its spec's seed is `seed + o_k * n`, so with
  `seeding="request"` every request keeps the seed it has on one engine, and with `seeding="batch"` each shard's call
  has its own seed that follows from the call alone (resume stays exact). Every server generates its shard at once;
  `collect` puts the samples back in prompt-major order. The engine's own time of the call is the slowest server's.
- weights (`ShardedWeights`): over CUDA IPC each bucket is packed once into one shared buffer that every server
  loads from at the same time (`transports.OwnIPC`; with `rollout.weight_transport vllm`, vLLM's IPC engine's
  buffer, each chunk's handle sent to every server: `transports.VLLMIPC`); other backends (gloo on CPU) send the
  buckets to each server in turn.
  `weights.send(wait=False)` / `logprobs_replicas_later` do not wait for the last replies (a sync with overlap: the
  servers load and score the canary probe while the trainer goes on; the replies are read before the generation
  queued behind them).
- `logprobs_replicas` (the sync canary): every server scores every sequence, and the canary checks each server's
  against the trainer, so a server that missed a sync cannot hide behind one that did not; `score` is server 0's.
- errors: a command goes to every server and every reply is read before the first failure is raised
  (`calls.command_all`), and a `submit` that fails part-way waits out the shards already sent, so no
  connection is left with a reply the next call would take for its own.
- sleep / wake / close go to every server; `stats()["engines"]` lists each server's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence

from ds_rlhf.rollout.base import (
    BucketPlan,
    Pending,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    RolloutTicket,
    SamplingSpec,
    TensorMeta,
    WeightTransport,
)
from ds_rlhf.rollout.server.calls import all_of, send_all, slowest_load
from ds_rlhf.rollout.server.client import RemoteVLLMEngine
from ds_rlhf.rollout.server.protocol import Command


def shard_bounds(n_prompts: int, n_engines: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) prompt ranges, one per engine used (at most `n_prompts` of them, none empty)."""
    used = max(1, min(n_engines, n_prompts))
    cuts = [n_prompts * i // used for i in range(used + 1)]
    return list(zip(cuts, cuts[1:]))


def shard_spec(spec: SamplingSpec, offset: int) -> SamplingSpec:
    """The spec of the shard starting at prompt `offset`: request seeds unchanged, a batch seed of its own."""
    return spec if spec.seed is None or offset == 0 else dataclasses.replace(spec, seed=spec.seed + offset * spec.n)


class ShardedWeights(WeightTransport):
    """Weights to every sidecar server. Where their transport `shares_device` (CUDA IPC: one buffer on the trainer's
    GPU), the first server's transport sends each bucket once to all of them at the same time; otherwise (gloo on
    CPU: each server has its own weight group) every bucket is held and sent to each server in turn through its
    own transport. `check_idle` refuses a sync while a generation is in flight."""

    def __init__(self, engines: Sequence[RemoteVLLMEngine], check_idle) -> None:
        super().__init__()
        self.engines, self.check_idle = engines, check_idle
        self.dtype = engines[0].weights.dtype

    def send(self, buckets, plan: BucketPlan | None = None, *, wait: bool = True) -> Pending:
        self.check_idle()
        t0 = time.perf_counter()
        lead = self.engines[0].weights
        if lead.shares_device and all(type(e.weights) is type(lead) for e in self.engines):
            if plan is None:
                buckets = [list(b) for b in buckets if b]
                plan = [[TensorMeta(n, tuple(t.shape), self.dtype) for n, t in b] for b in buckets]
            nbytes, done = lead.send_to(self.engines, buckets, plan, wait=wait)
        else:
            zero3 = getattr(buckets, "zero3", False)  # gathered tensors are released after their bucket: copies
            held = [[(n, t.clone() if zero3 else t) for n, t in b] for b in buckets]
            owed = all_of([e.weights.send(held, plan, wait=False) for e in self.engines])
            done = Pending(lambda: slowest_load(owed.result()))
            if wait:
                done.result()
            nbytes = sum(t.numel() * t.element_size() for b in held for _, t in b)
        self.record(nbytes, time.perf_counter() - t0)
        return done

    def load(self, named_tensors) -> None:
        self.check_idle()
        tensors = list(named_tensors)
        t0 = time.perf_counter()
        for e in self.engines:
            e.weights.load(tensors)
        self.record(sum(t.numel() * t.element_size() for _, t in tensors), time.perf_counter() - t0)


class ShardedRolloutEngine(RolloutEngine):
    backend = "vllm"
    placement = "sidecar"

    def __init__(self, engines: Sequence[RemoteVLLMEngine]) -> None:
        super().__init__()
        if not engines:
            raise ValueError("ShardedRolloutEngine needs at least one engine")
        if not all(e.defers_replies for e in engines):  # a client that does not defer serves several ranks
            raise RolloutError("several sidecar engines serve one training rank; this run has several ranks")
        self.engines = list(engines)
        self.weights = ShardedWeights(self.engines, self._check_idle)
        self._in_flight = False
        self._c.extra["engines"] = len(self.engines)  # each server's own stats (vLLM version too): stats()["engines"]

    @property
    def defers_replies(self) -> bool:
        return True  # one training rank (checked above)

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        return self.collect(self.submit(prompts, spec))

    def submit(self, prompts: list[list[int]], spec: SamplingSpec) -> RolloutTicket:
        self._check_idle()
        started = []
        try:
            for engine, (a, b) in zip(self.engines, shard_bounds(len(prompts), len(self.engines))):
                started.append((engine, a, engine.submit(prompts[a:b], shard_spec(spec, a))))
        except RolloutError:
            for engine, _, sub in started:  # the shards already sent: wait them out, so those servers stay usable
                with contextlib.suppress(RolloutError):
                    engine.collect(sub)
            raise
        self._in_flight = True
        return RolloutTicket(pending=started, started=started[0][2].started)

    def collect(self, ticket: RolloutTicket) -> list[RolloutSample]:
        if ticket.samples is not None:
            return ticket.samples
        if not self._in_flight:
            raise RolloutError("no generation in flight to collect")
        self._in_flight = False
        samples, seconds, tokens, failure = [], 0.0, 0, None
        for engine, offset, sub in ticket.pending:  # collect every shard, even after a failure: no reply left behind
            try:
                part = engine.collect(sub)
            except RolloutError as e:
                failure = failure or e
                continue
            samples.extend(dataclasses.replace(s, prompt_index=s.prompt_index + offset) for s in part)
            call_s, call_tokens = engine.last_generate()
            seconds, tokens = max(seconds, call_s), tokens + call_tokens
        if failure is not None:
            raise failure
        self.record_generate(samples, seconds, tokens)
        return samples

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.logprobs_replicas(sequences)[0]

    def logprobs_replicas(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        """Every server scores every sequence (at once): one list per server, for the canary to check each."""
        return self.logprobs_replicas_later(sequences).result()

    def logprobs_replicas_later(self, sequences: list[list[int]]) -> Pending:
        self._check_idle()
        return all_of(send_all(self.engines, Command.LOGPROBS, sequences))

    def _check_idle(self) -> None:
        if self._in_flight:
            raise RolloutError("a generation is in flight: collect it before any other call")

    # ---- the rest goes to every engine -------------------------------------------------------------------------
    def sleep(self) -> None:
        for e in self.engines:
            e.sleep()
        self.sleeping = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        for e in self.engines:
            e.wake(tags)
        if tags is None or "kv_cache" in tags:
            self.sleeping = False

    def stats(self) -> dict:
        return {**super().stats(), "engines": [e.stats() for e in self.engines]}

    def close(self) -> None:
        for e in self.engines:  # every server shuts down at once, then each is waited for
            e.begin_close()
        for e in self.engines:
            e.close()
