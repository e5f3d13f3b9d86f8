"""One GPU split between the trainer and its sidecar vLLM engines (`rollout.sm_split`), instead of taking turns.

Without it the trainer's process and each engine process hold CUDA contexts of their own, and the GPU time-slices
between them: a kernel of one waits for the other's slice. Under CUDA MPS the processes' kernels run at once, each
process on at most its `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of the SMs.

`start_split(cfg)` runs first thing in `RLTrainer` (before the preflight or the process group touch CUDA: an MPS
client connects when the CUDA driver initialises, `cuInit`, and reads its variables then):

- `mps`: a CUDA MPS control daemon of the run's own (`nvidia-cuda-mps-control -d` with `CUDA_MPS_PIPE_DIRECTORY`
  and `CUDA_MPS_LOG_DIRECTORY` in a temp directory of its own: the device's compute mode is left as it is and other
  users' daemons are not touched); this process's environment gets those variables and the trainer's percentage;
  `engine_env()` is what each engine process gets on top (`make_rollout_engine(server_env=...)`). A guard process
  (`run/mps_guard.py`) tells the daemon to quit when `close()` runs (the run's lifecycle at exit, or a failed
  start) or when this process ends in any other way.
- `green`: CUDA green contexts partition the SMs between the contexts of one process; the engines are other
  processes, whose contexts still take turns with the trainer's without MPS. Refused with one line naming what is
  missing (torch's `torch.cuda.GreenContext`, and a split between processes).
- `auto`: `mps` where it can run (one training rank, `nvidia-cuda-mps-control` on PATH, the GPU not in an exclusive
  or prohibited compute mode, CUDA not yet initialised in this process), else time-slicing, with one line saying why.

The engines' percentage is `rollout.engine_sm_percent`, else `memory/sm_share.py:engine_sm_percent` of the planned
work; the trainer's is `rollout.trainer_sm_percent`, else 100 minus the engines'.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds_rlhf.errors import ConfigError
from ds_rlhf.memory.sm_share import engine_sm_percent, planned_work
from ds_rlhf.run.mps_guard import mps_env

MPS_CONTROL = "nvidia-cuda-mps-control"
PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_initialized() -> bool:
    """Whether the CUDA driver was initialised in this process: libcuda's `cuDeviceGetCount` answers
    CUDA_ERROR_NOT_INITIALIZED before `cuInit` and initialises nothing. False without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def compute_mode() -> str:
    """The compute mode of this process's GPU as `nvidia-smi` names it ("Default", "Exclusive_Process",
    "Prohibited"); "" when it cannot tell."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", first],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def green_missing() -> str:
    """What the green-context split lacks here (never empty: the engines are other processes)."""
    if not getattr(getattr(torch.cuda, "green_contexts", None), "SUPPORTED", False):
        return (f"torch {torch.__version__} has no usable torch.cuda.GreenContext (built without green-context "
                "support), and green contexts partition the SMs of one process only")
    return ("torch.cuda.GreenContext partitions the SMs between the contexts of one process, and the sidecar engines "
            "are other processes, which take turns with the trainer without MPS")


@dataclass(frozen=True)
class Probe:
    """The machine as the split sees it (tests give their own)."""

    which: Callable[[str], str | None] = shutil.which
    compute_mode: Callable[[], str] = compute_mode
    cuda_initialized: Callable[[], bool] = cuda_initialized
    green_missing: Callable[[], str] = green_missing


@dataclass(frozen=True)
class SplitDecision:
    """`mode` "mps" or "off"; the percentages (0 when off); `line`: the decision as logged ("" for off asked)."""

    mode: str
    engine_percent: int = 0
    trainer_percent: int = 0
    control: str = ""
    line: str = ""


def _mps_obstacle(cfg, world_size: int, probe: Probe) -> tuple[str, str]:
    """(why MPS cannot run here, or ""; the control command's path)."""
    if cfg.rollout.placement != "sidecar" or cfg.rollout.backend == "hf":
        return f"rollout.placement={cfg.rollout.placement} runs no vLLM process beside the trainer", ""
    if world_size > 1:
        return f"{world_size} training ranks (the split serves one rank and its engines on one GPU)", ""
    control = probe.which(MPS_CONTROL)
    if not control:
        return f"{MPS_CONTROL} is not on PATH", ""
    mode = probe.compute_mode()
    if mode and mode.lower() != "default":
        return f"the GPU's compute mode is {mode} (MPS here shares a GPU in the Default mode only)", control
    if probe.cuda_initialized():
        return ("CUDA is already initialised in this process (an MPS client joins when CUDA initialises); start "
                "the run in a fresh process"), control
    return "", control


def decide_split(cfg, *, world_size: int = 1, probe: Probe = Probe()) -> SplitDecision:
    """What `rollout.sm_split` comes to here; ConfigError (one line) when `mps` or `green` cannot run."""
    asked = cfg.rollout.sm_split
    if asked == "off":
        return SplitDecision("off")
    if asked == "green":
        raise ConfigError(f"rollout.sm_split=green: {probe.green_missing()}; use --rollout.sm_split mps (or auto)")
    why, control = _mps_obstacle(cfg, world_size, probe)
    if why and asked == "mps":
        raise ConfigError(f"rollout.sm_split=mps: {why}; use --rollout.sm_split auto or off")
    if why:
        return SplitDecision("off", line=f"[sm_split] auto: time-slicing the GPU: {why}")
    work = planned_work(cfg)
    engines = cfg.rollout.engine_sm_percent or engine_sm_percent(work)
    trainer = cfg.rollout.trainer_sm_percent or max(1, 100 - engines)
    source = ("rollout.engine_sm_percent" if cfg.rollout.engine_sm_percent else
              f"from the planned work: {work.gen_tokens} generated tokens, {work.train_tokens} trained x "
              f"{work.passes:g} passes per step")
    return SplitDecision("mps", engines, trainer, control,
                         f"[sm_split] {asked}: CUDA MPS, engines {engines}% of the SMs ({source}), trainer {trainer}%")


def daemon_env(directory: str) -> dict[str, str]:
    """The control daemon's environment: this process's, the run's MPS directories, no client percentage, and no
    `CUDA_VISIBLE_DEVICES` of indices (a daemon started with one renumbers the devices its clients see, so the
    clients' own indices would name other GPUs; UUIDs, `GPU-...`, mean the same GPU to both and are kept)."""
    env = dict(os.environ, **mps_env(directory))
    env.pop(PERCENT_VAR, None)
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and not all(d.strip().startswith(("GPU-", "MIG-")) for d in visible.split(",")):
        env.pop("CUDA_VISIBLE_DEVICES")
    return env


@dataclass
class GPUSplit:
    """A started split: `engine_env()` for each engine process; `close()` (idempotent) restores this process's
    environment and has the guard quit the daemon."""

    decision: SplitDecision
    directory: str = ""
    guard: subprocess.Popen | None = None
    _saved: dict[str, str | None] = field(default_factory=dict)

    def engine_env(self) -> dict[str, str]:
        if self.decision.mode != "mps":
            return {}
        return {**mps_env(self.directory), PERCENT_VAR: str(self.decision.engine_percent)}

    def close(self, wait_s: float = 2.0) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()
        if self.guard is not None:
            self.guard.stdin.close()
            # the daemon waits for its clients (this process among them): past wait_s the guard goes on in its session
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.guard.wait(wait_s)
            self.guard = None


def start_split(cfg, *, world_size: int | None = None, probe: Probe = Probe(),
                announce: Callable[[str], object] = print) -> GPUSplit:
    """Decide, log the decision once, and for `mps` start the run's daemon and set this process's variables."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    decision = decide_split(cfg, world_size=world_size, probe=probe)
    if decision.mode != "mps":
        if decision.line:
            announce(decision.line)
        return GPUSplit(decision)
    directory = tempfile.mkdtemp(prefix="ds_rlhf_mps_")
    env = mps_env(directory)
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    started = subprocess.run([decision.control, "-d"], env=daemon_env(directory), capture_output=True, text=True,
                             timeout=60)
    if started.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        said = (started.stderr or started.stdout).strip().replace("\n", " ")
        raise ConfigError(f"rollout.sm_split={cfg.rollout.sm_split}: `{decision.control} -d` exited with "
                          f"{started.returncode} ({said or 'no output'}); use --rollout.sm_split off")
    guard = subprocess.Popen([sys.executable, "-m", "ds_rlhf.run.mps_guard", decision.control, directory],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ), start_new_session=True)
    split = GPUSplit(decision, directory, guard)
    for key, value in {**env, PERCENT_VAR: str(decision.trainer_percent)}.items():
        split._saved[key] = os.environ.get(key)
        os.environ[key] = value
    announce(f"{decision.line}; the run's MPS daemon in {directory}, stopped at exit")
    return split
