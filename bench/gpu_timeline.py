"""GPU utilisation over a benchmark run: an NVML sampler thread, per-phase means, and a PNG timeline.

`Sampler(period_s=0.1)` samples NVML (utilisation %, memory used) every 100 ms in a daemon thread (without pynvml it
reads `nvidia-smi --query-gpu=... -lms` instead, where that is on PATH; `Sampler.source` says which); `summarize`
averages the samples over a time window and over each phase's intervals (from `PhaseTimer.events`); `render`
draws the utilisation with the phases shaded (matplotlib; `python bench/gpu_timeline.py result.json out.png`
renders a saved result where the GPU machine has no matplotlib).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

PHASE_COLOURS = {"rollout": "#4c72b0", "reward": "#dd8452", "old_logp": "#8172b3", "reference": "#937860",
                 "critic": "#da8bc3", "train": "#55a868", "sync": "#c44e52"}


class Sampler:
    """`source`: "nvml" (pynvml), "nvidia-smi" (no pynvml: `nvidia-smi -lms` parsed in the thread) or None (no GPU
    or neither tool: no samples, the benchmark still runs)."""

    NVIDIA_SMI = ("nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits")

    def __init__(self, period_s: float = 0.1, device_index: int = 0):
        self.period_s, self.samples = period_s, []  # (time.time(), util %, memory used GiB)
        self.device_index, self.source, self._proc = device_index, None, None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.source = "nvml"
        except Exception:  # noqa: BLE001 - no GPU / no NVML: try nvidia-smi, else an empty timeline
            self._nvml = None
            if shutil.which(self.NVIDIA_SMI[0]):
                self.source = "nvidia-smi"
        self._thread = threading.Thread(target=self._run if self._nvml else self._run_smi, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**30
            self.samples.append((time.time(), float(util), mem))

    def _run_smi(self) -> None:
        """One `nvidia-smi -lms` process printing "memory.used MiB, utilization %" lines until __exit__ ends it."""
        cmd = [*self.NVIDIA_SMI, f"--id={self.device_index}", f"-lms={max(1, int(self.period_s * 1000))}"]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        for line in self._proc.stdout:
            if self._stop.is_set():
                break
            sample = parse_smi_line(line)
            if sample is not None:
                self.samples.append((time.time(), sample[1], sample[0]))

    def __enter__(self) -> Sampler:
        if self.source is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def parse_smi_line(line: str) -> tuple[float, float] | None:
    """(memory used GiB, utilisation %) from one `memory.used,utilization.gpu` csv line (MiB, %), else None."""
    parts = [p.strip() for p in line.split(",")]
    try:
        return float(parts[0]) / 1024, float(parts[1])
    except (IndexError, ValueError):  # a header, "[N/A]", an error line
        return None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(samples: list, events: list, window: tuple[float, float]) -> dict:
    """Mean utilisation over `window` (start, end) and over each phase's intervals inside it."""
    lo, hi = window
    inside = [s for s in samples if lo <= s[0] <= hi]
    out = {"gpu_util_mean": _mean([s[1] for s in inside]), "gpu_mem_max_gib": max((s[2] for s in inside), default=None),
           "samples": len(inside), "per_phase": {}}
    for name in sorted({e[0] for e in events}):
        spans = [(a, b) for n, a, b in events if n == name and a >= lo and b <= hi]
        vals = [s[1] for s in inside if any(a <= s[0] <= b for a, b in spans)]
        out["per_phase"][name] = {"gpu_util_mean": _mean(vals), "seconds": sum(b - a for a, b in spans)}
    return out


def render(samples: list, events: list, path: str, title: str = "", window: tuple[float, float] | None = None) -> bool:
    """Utilisation over time with the phases shaded; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = samples[0][0] if samples else (events[0][1] if events else 0.0)
    fig, ax = plt.subplots(figsize=(12, 3.2))
    seen = set()
    for name, a, b in events:
        ax.axvspan(a - t0, b - t0, color=PHASE_COLOURS.get(name, "#bbbbbb"), alpha=0.25, lw=0,
                   label=None if name in seen else name)
        seen.add(name)
    ax.plot([s[0] - t0 for s in samples], [s[1] for s in samples], color="black", lw=0.8, label="GPU util %")
    if window is not None:
        ax.axvline(window[0] - t0, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("NVML utilisation %")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend(loc="upper right", ncol=8, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    from pathlib import Path

    result = json.loads(Path(sys.argv[1]).read_text())
    tl = result["timeline"]
    ok = render(tl["samples"], tl["events"], sys.argv[2], title=result.get("tag", ""),
                window=tuple(tl["window"]) if tl.get("window") else None)
    sys.exit(0 if ok else "matplotlib is not installed")
