"""GPU memory per process while a benchmark runs (`bench/rl_step_gpu.py`'s `gpu_processes`): each process's
memory on the device with the device's own use, sampled in a thread, and the trainer's PyTorch allocator peaks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path


class ProcessMemory:
    """GPU memory per process on device `index`, every `period_s` in a thread: NVML's compute processes (pynvml),
    else `nvidia-smi --query-compute-apps=pid,used_memory`; with each sample the whole device's used memory, so
    `summary()` can give the processes at the device's peak. A process is "trainer" (this one), "engine" (a
    descendant of this one: the sidecar vLLM processes) or "other" (another process, or a PID from outside this
    container's PID namespace, which NVML may report); a process's role is read when it is first sampled, while it
    runs (the engines have exited by the time `summary()` is called)."""

    SMI = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    SMI_DEVICE = ("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")

    def __init__(self, period_s: float = 0.5, index: int = 0, read=None):
        self.period_s, self.index, self.source = period_s, index, None
        self.samples: list[tuple[float, float, dict[int, float]]] = []  # (time, device used GiB, {pid: GiB})
        self.roles: dict[int, str] = {}  # pid -> role, read when first sampled
        self._stop = threading.Event()
        self._read = read
        if read is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
                self._read, self.source = self._read_nvml, "nvml"
            except Exception:  # noqa: BLE001 - no NVML: nvidia-smi where it is on PATH, else nothing recorded
                if shutil.which("nvidia-smi"):
                    self._read, self.source = self._read_smi, "nvidia-smi"
        else:
            self.source = "given"
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read_nvml(self) -> tuple[float, dict[int, float]]:
        used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**30
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        return used, {int(p.pid): (p.usedGpuMemory or 0) / 2**30 for p in procs}

    def _read_smi(self) -> tuple[float, dict[int, float]]:
        def run(cmd):
            return subprocess.run([*cmd, f"--id={self.index}"], capture_output=True, text=True, timeout=10).stdout

        used = float(run(self.SMI_DEVICE).split()[0]) / 1024
        procs = {}
        for line in run(self.SMI).splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
                procs[int(pid)] = float(mib) / 1024
        return used, procs

    def sample(self) -> None:
        used, procs = self._read()
        for pid in procs:
            if pid not in self.roles:
                self.roles[pid] = self.role(pid)
        self.samples.append((time.time(), used, procs))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed read (a process gone mid-query) skips one sample
                continue

    def __enter__(self) -> ProcessMemory:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @staticmethod
    def role(pid: int, me: int | None = None) -> str:
        """"trainer" (`me`, default this process), "engine" (a descendant of it, from /proc) or "other"."""
        me = os.getpid() if me is None else me
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == me:
                return "trainer" if not seen else "engine"
            seen.add(pid)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's PID (field 4)
            except (OSError, ValueError, IndexError):
                return "other"
        return "other"

    def summary(self, me: int | None = None) -> dict:
        def listed(procs: dict[int, float]) -> list[dict]:
            return [{"pid": pid, "role": self.roles.get(pid) or self.role(pid, me), "used_gib": round(gib, 3)}
                    for pid, gib in sorted(procs.items(), key=lambda kv: -kv[1])]

        out = {"source": self.source, "period_s": self.period_s, "samples": len(self.samples), "at_device_peak": None,
               "process_peaks": []}
        if not self.samples:
            return out
        t, used, procs = max(self.samples, key=lambda s: s[1])
        peaks: dict[int, float] = {}
        for _, _, each in self.samples:
            for pid, gib in each.items():
                peaks[pid] = max(gib, peaks.get(pid, 0.0))
        out["at_device_peak"] = {"time": t, "device_used_gib": round(used, 3), "processes": listed(procs),
                                 "processes_gib": round(sum(procs.values()), 3)}
        out["process_peaks"] = listed(peaks)
        return out


def trainer_torch_memory() -> dict | None:
    """This process's PyTorch allocator peaks (GiB): what it allocated, and what it reserved from the driver."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "max_memory_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}
