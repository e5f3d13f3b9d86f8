"""Wall-clock time per phase of a step (rollout, reward, reference, critic, train, sync)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per named phase; `pop()` returns them as `time/<phase>` metrics and resets."""

    def __init__(self, sync_cuda: bool = False):
        self._totals: dict[str, float] = defaultdict(float)
        self._sync_cuda = sync_cuda  # GPU work is async: synchronise so a phase is charged its own kernels

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._totals[name] += time.perf_counter() - start

    def _sync(self) -> None:
        if self._sync_cuda:
            import torch

            torch.cuda.synchronize()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self._totals.items()}
        out["time/step"] = sum(self._totals.values())
        self._totals.clear()
        return out
