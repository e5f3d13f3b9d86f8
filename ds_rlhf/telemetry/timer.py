"""Wall-clock time per phase of a step (data, rollout, reward, reference, critic, train, sync)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per named phase; `pop()` returns them as `time/<phase>` metrics and resets.

    Phases may nest (the prompt draw, phase `data`, runs inside `rollout` when the rollout schedule submits a
    batch): a phase is charged its own, exclusive time, so an inner phase's seconds are not also counted in the
    outer one and `time/step` (the sum of the phases) counts every second once.
    """

    def __init__(self, sync_cuda: bool = False, keep_events: int = 100_000):
        self._totals: dict[str, float] = defaultdict(float)
        self._sync_cuda = sync_cuda  # GPU work is async: synchronise so a phase is charged its own kernels
        self._inner: list[float] = []  # per open phase: seconds spent in phases nested inside it
        # (phase, start, end) in time.time() seconds, for timelines next to other samplers (e.g. NVML); a nested
        # phase's event lies inside its outer phase's event
        self.events: deque[tuple[str, float, float]] = deque(maxlen=keep_events)
        self.observer = None  # optional: .enter(phase) / .exit(phase) around every phase (the memory profiler)

    @contextmanager
    def phase(self, name: str):
        self._sync()
        if self.observer is not None:
            self.observer.enter(name)
        start, wall = time.perf_counter(), time.time()
        self._inner.append(0.0)
        try:
            yield
        finally:
            self._sync()
            if self.observer is not None:
                self.observer.exit(name)
            seconds = time.perf_counter() - start
            nested = self._inner.pop()
            self._totals[name] += max(0.0, seconds - nested)
            if self._inner:
                self._inner[-1] += seconds
            self.events.append((name, wall, wall + seconds))

    def _sync(self) -> None:
        if self._sync_cuda:
            import torch

            torch.cuda.synchronize()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self._totals.items()}
        out["time/step"] = sum(self._totals.values())
        self._totals.clear()
        return out
