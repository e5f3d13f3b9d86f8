"""vLLM-CPU's shared-memory leftovers: remove the /dev/shm buffers a killed run left behind (no vLLM API here).

Kept apart from `vllm_adapter.py` (which holds every vLLM call) because it only reads /proc and unlinks files.
"""

from __future__ import annotations

import contextlib
import glob
import os


def _mapped_shm(maps_files) -> set[str]:
    found = set()
    for path in maps_files:
        try:
            with open(path) as f:
                found.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:  # a process that ended while we looked, or one we may not read
            continue
    return found


def cpu_shm_cleanup(before_init: bool) -> None:
    """vLLM-CPU's multi-rank communicator names its /dev/shm buffers after the group only (`...-[0-1]-cpushm_<r>`),
    the same in every run, and removes them only in C++ teardown: a killed run leaves them behind, and the next run
    then fails with "create shm in SHMManager failed. errno: 17". Before init we remove such files that no process
    maps; after init (every rank has joined every peer's buffer inside vLLM's init) we drop the names this process
    maps, so the memory goes with the last mapping and nothing is left behind, whatever happens later."""
    if before_init:
        in_use = _mapped_shm(glob.glob("/proc/[0-9]*/maps"))
        candidates = [p for p in glob.glob("/dev/shm/*-cpushm_*") if p not in in_use]
    else:
        candidates = [p for p in _mapped_shm(["/proc/self/maps"]) if "-cpushm_" in p]
    for path in candidates:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
