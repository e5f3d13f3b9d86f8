"""Wall-clock time per phase of a step (rollout, reward, reference, critic, train, sync)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per named phase; `pop()` returns them as `time/<phase>` metrics and resets."""

    def __init__(self, sync_cuda: bool = False, keep_events: int = 100_000):
        self._totals: dict[str, float] = defaultdict(float)
        self._sync_cuda = sync_cuda  # GPU work is async: synchronise so a phase is charged its own kernels
        # (phase, start, end) in time.time() seconds, for timelines next to other samplers (e.g. NVML)
        self.events: deque[tuple[str, float, float]] = deque(maxlen=keep_events)

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self._sync()
            seconds = time.perf_counter() - start
            self._totals[name] += seconds
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
