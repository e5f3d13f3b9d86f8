"""An in-process rollout engine that generates on its own thread (and, on a GPU, its own CUDA stream), so one
process can train while its colocated vLLM engine generates the next batch (`rollout.async_generation` with
`rollout.placement colocated` and one training rank).

Why a thread and not only the sidecar's process: kernels of two processes on one GPU time-share it (the driver
switches between their contexts), so the trainer beside three sidecar engines trained 2.5x slower than alone
(docs/PERFORMANCE.md, "Several vLLM engines on one GPU"). Kernels of one process on two streams can run on the
GPU at the same time: vLLM's small decode kernels fill the SMs the trainer's matmuls leave, and its stream has
the higher priority, so its host-bound decode loop is not held up behind the trainer's queue. The weights need no
copy or CUDA-IPC hop either: the sync loads them in place, as the synchronous colocated engine does.

Ordering: `submit` records an event on the caller's stream (the weights just loaded there) that the generation
stream waits for; `collect` makes the caller's stream wait for the generation's. Only one ticket may be
outstanding, and every other call (sync, score, sleep, adapters) raises while it is (the `RolloutEngine`
contract), so the weights never change under a running generation.

Determinism: the wrapped engine's samples depend on its inputs and seeds only (vLLM reseeds its generators per call
under `seeding=batch`, and restores the caller's RNG afterwards; HF draws from its own generators), so a run's
samples match the synchronous schedule's for the same weights. The trainer must not draw from torch's global RNG
while a batch generates (RL training has no dropout: the policy loss draws nothing); `rl_update`'s shuffles use
their own generator.

Not for several ranks: a colocated vLLM engine over several ranks steps them in lockstep through collectives,
which must not run beside the trainer's own on another thread (`rl_build` keeps those engines synchronous).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ds_rlhf.rollout.base import (
    BucketPlan,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    RolloutTicket,
    SamplingSpec,
)

STREAM_PRIORITY = -1  # the generation stream's CUDA priority (lower = higher; the trainer's stream has 0)


class _Job:
    def __init__(self, future: Future, done: list) -> None:
        self.future, self.done = future, done  # done: [the generation stream's end event] once it finished


class ThreadedRolloutEngine(RolloutEngine):
    """`inner` (an in-process engine: colocated vLLM or HF) with `submit` running its `generate` on one worker
    thread; `device` is the engine's torch device (a CUDA device gets its own stream of `STREAM_PRIORITY`)."""

    background = True

    def __init__(self, inner: RolloutEngine, device: torch.device | str | None = None) -> None:
        super().__init__()
        if getattr(inner, "background", False):
            raise ValueError("the engine already generates on its own thread")
        self.inner = inner
        self.backend, self.placement = inner.backend, inner.placement
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_rlhf-rollout",
                                        initializer=self._init_thread)
        self._job: _Job | None = None
        self._lock = threading.Lock()

    # ---- the worker thread -------------------------------------------------------------------------------------
    def _init_thread(self) -> None:
        if self._cuda:  # torch's current stream is per thread: this one's belongs to the generation
            self._stream = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY)
            torch.cuda.set_stream(self._stream)  # through vLLM's patch where vLLM is imported (it tracks the stream)

    def _run(self, prompts, spec, ready, done: list) -> list[RolloutSample]:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        try:
            return self.inner.generate(prompts, spec)
        finally:
            if self._cuda:
                end = torch.cuda.Event()
                end.record(torch.cuda.current_stream(self.device))
                done.append(end)

    # ---- the contract ------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._job is not None

    def _idle(self, what: str) -> None:
        if self._job is not None:
            raise RolloutError(f"{what} while a generation is in flight: collect its ticket first (one ticket at a "
                               "time; nothing else may run on the engine until it is collected)")

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        return self.collect(self.submit(prompts, spec))

    def submit(self, prompts: list[list[int]], spec: SamplingSpec) -> RolloutTicket:
        with self._lock:
            self._idle("submit")
            ready = None
            if self._cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            done: list = []
            self._job = _Job(self._pool.submit(self._run, prompts, spec, ready, done), done)
            return RolloutTicket(pending=self._job)

    def collect(self, ticket: RolloutTicket) -> list[RolloutSample]:
        if ticket.samples is not None:
            return ticket.samples
        job = ticket.pending
        if job is not self._job or job is None:
            raise RolloutError("collect: this ticket is not the engine's outstanding generation")
        try:
            samples = job.future.result()
        finally:
            self._job = None
            if job.done:
                torch.cuda.current_stream(self.device).wait_event(job.done[0])
        ticket.samples = samples
        return samples

    def last_generate(self) -> tuple[float, int] | None:
        return self.inner.last_generate()

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        self._idle("score")
        return self.inner.score(sequences)

    def score_replicas(self, sequences: list[list[int]]) -> list[list[list[float]]]:
        self._idle("score")
        return self.inner.score_replicas(sequences)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._idle("a weight update")
        self.inner.update_weights(named_tensors)

    def update_weight_buckets(self, buckets, plan: BucketPlan | None = None) -> None:
        self._idle("a weight update")
        self.inner.update_weight_buckets(buckets, plan)

    @property
    def lora_enabled(self) -> bool:
        return self.inner.lora_enabled

    def load_adapter(self, path: str) -> int:
        self._idle("load_adapter")
        return self.inner.load_adapter(path)

    def sleep(self) -> None:
        self._idle("sleep")
        self.inner.sleep()
        self.sleeping = self.inner.sleeping

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self._idle("wake")  # the schedule wakes before every submit, so this never waits
        self.inner.wake(tags)
        self.sleeping = self.inner.sleeping

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.inner.weight_dtype

    def reset_cache(self) -> None:
        self._idle("reset_cache")
        self.inner.reset_cache()

    def stats(self) -> dict:
        return {**self.inner.stats(), "generation_thread": True}

    def close(self) -> None:
        """Wait for a generation still running (a thread cannot be stopped mid-call; tearing the engine down under
        it would crash the process), then stop the thread and close the engine."""
        job, self._job = self._job, None
        if job is not None:
            with contextlib.suppress(Exception):  # the run is ending; its failure is reported elsewhere
                job.future.result()
        self._pool.shutdown(wait=True)
        self.inner.close()
