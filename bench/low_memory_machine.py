"""The machine and the environment of bench/low_memory_gpu.py: the checkout's paths, GPU 0 from nvidia-smi, the
package versions, the git commit, the host memory, and the environment of each phase's child process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
GiB = 1 << 30


def gpu_info() -> dict | None:
    """Name and memory of GPU 0 from nvidia-smi (no CUDA context in this process), or None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits", "--id=0"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = [p.strip() for p in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(parts) < 3:
        return None
    try:
        return {"name": parts[0], "memory_gib": float(parts[1]) / 1024, "driver": parts[2]}
    except ValueError:
        return None


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "deepspeed", "vllm", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)  # "-dirty": the files differ from HEAD (a device copy's HEAD can lag)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def child_env(gpu: bool) -> dict:
    """This environment without a launcher's distributed variables (each phase is a world of one on its own port),
    the checkout on PYTHONPATH, offline hubs, and the CPU settings of scripts/env.sh when there is no GPU."""
    from ds_rlhf.distributed import clean_dist_env

    env = clean_dist_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for k, v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", PYTHONUNBUFFERED="1").items():
        env.setdefault(k, v)
    if not gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def host_ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
