"""A profile of one training phase of an RL run: where the trainer's device time goes.

`PhaseProfiler(step)` hangs on the trainer's `PhaseTimer` as its observer and runs `torch.profiler` through the
`step`-th `train` phase (the policy update: forward, backward and optimizer step of every micro-batch). On CUDA it
records this process's kernels; on CPU (the tiny check) its operators. `summary()` says:

- `wall_seconds`: the phase's wall time (the timer synchronises CUDA at both ends);
- `busy_seconds` / `busy_frac`: the union of the recorded kernels' intervals, so `1 - busy_frac` is time the
  trainer's device had no kernel of this process running (launch gaps, host work, waits);
- `kernel_seconds`: the sum of the kernels' own durations (above `busy_seconds` only where kernels overlap);
- `gaps`: the idle intervals between consecutive kernels (count, sum, median and the longest ones);
- `top`: the kernels with the most total time (count, total and mean microseconds).

Run once with the engines idle (a synchronous step trains alone) and once beside them (`--async`): when the same
kernels take longer per call beside the engines, the GPU is shared (time-slicing, memory bandwidth); when
`busy_frac` drops, the trainer is waiting on its host side (launch gaps).
"""

from __future__ import annotations

import statistics
import time


class PhaseProfiler:
    """Profiles the `step`-th occurrence of `phase` (1-based); passes every call on to `inner` (another observer)."""

    def __init__(self, step: int, phase: str = "train", inner=None, top: int = 15):
        if step < 1:
            raise ValueError(f"profile step must be >= 1, got {step}")
        self.step, self.phase, self.inner, self.top = step, phase, inner, top
        self.seen = 0
        self._prof = None
        self.result: dict | None = None

    def enter(self, name: str) -> None:
        if self.inner is not None:
            self.inner.enter(name)
        if name != self.phase:
            return
        self.seen += 1
        if self.seen == self.step:
            import torch
            from torch.profiler import ProfilerActivity, profile

            self._cuda = torch.cuda.is_available()
            self._prof = profile(activities=[ProfilerActivity.CUDA if self._cuda else ProfilerActivity.CPU])
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def exit(self, name: str) -> None:
        if name == self.phase and self._prof is not None:
            prof, self._prof = self._prof, None
            wall = time.perf_counter() - self._t0
            prof.__exit__(None, None, None)
            self.result = summarize_events(_device_events(prof, self._cuda), wall, step=self.step, top=self.top)
            self.result["device"] = "cuda" if self._cuda else "cpu"
        if self.inner is not None:
            self.inner.exit(name)

    def summary(self) -> dict | None:
        return self.result


def _device_events(prof, cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the recorded kernels (CUDA) or top-level operators (CPU)."""
    out = []
    for ev in prof.events():
        kind = str(getattr(ev, "device_type", "")).rsplit(".", 1)[-1]
        if cuda and kind != "CUDA":
            continue
        if not cuda and (kind != "CPU" or ev.cpu_parent is not None):
            continue
        out.append((ev.name, float(ev.time_range.start), float(ev.time_range.end)))
    return out


def summarize_events(events: list[tuple[str, float, float]], wall_seconds: float, step: int, top: int = 15) -> dict:
    """Busy time (union of intervals), gaps between them and the heaviest names, from (name, start_us, end_us)."""
    if not events:
        return {"step": step, "wall_seconds": wall_seconds, "events": 0}
    events = sorted(events, key=lambda e: e[1])
    first, last = events[0][1], max(e[2] for e in events)
    busy, gaps = 0.0, []
    cur_start, cur_end = events[0][1], events[0][2]
    for _, start, end in events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    per_name: dict[str, list[float]] = {}
    for name, start, end in events:
        per_name.setdefault(name, []).append(end - start)
    heaviest = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "step": step, "wall_seconds": wall_seconds, "events": len(events), "span_seconds": (last - first) / 1e6,
        "busy_seconds": busy / 1e6, "busy_frac": busy / 1e6 / wall_seconds if wall_seconds > 0 else 0.0,
        "kernel_seconds": sum(e[2] - e[1] for e in events) / 1e6,
        "gaps": {"count": len(gaps), "seconds": sum(gaps) / 1e6,
                 "median_us": statistics.median(gaps) if gaps else 0.0,
                 "longest_us": sorted(gaps, reverse=True)[:5]},
        "top": [{"name": name[:120], "count": len(d), "total_ms": sum(d) / 1e3, "mean_us": sum(d) / len(d)}
                for name, d in heaviest],
    }
