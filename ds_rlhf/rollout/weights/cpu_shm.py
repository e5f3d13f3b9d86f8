"""Shared-memory leftovers of a killed run: remove the /dev/shm buffers no process maps any more (vLLM-CPU's
communicator buffers, the shared-weights buffer of `rollout.weight_transport shared` on CPU); no vLLM API here.

Kept apart from `vllm_adapter.py` (which holds every vLLM call) because it only reads /proc and unlinks files.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time

SETTLE_S = 60.0  # a file younger than this may belong to a run still starting (created, not mapped yet): kept


def _mapped_shm(maps_files, directory: str = "/dev/shm") -> set[str]:
    """The files under `directory` that the processes of `maps_files` (/proc/<pid>/maps) map."""
    found, marker = set(), directory.rstrip("/") + "/"
    for path in maps_files:
        try:
            with open(path) as f:
                found.update(line.split(None, 5)[-1].strip() for line in f if marker in line)
        except OSError:  # a process that ended while we looked, or one we may not read
            continue
    return found


def remove_unmapped(pattern: str, *, settle_s: float = SETTLE_S) -> list[str]:
    """Remove the files matching `pattern` that no process maps and that are older than `settle_s` seconds (a
    killed run's buffers); returns the paths removed."""
    in_use = _mapped_shm(glob.glob("/proc/[0-9]*/maps"), os.path.dirname(pattern))
    removed, now = [], time.time()
    for path in glob.glob(pattern):
        with contextlib.suppress(FileNotFoundError):
            if path not in in_use and now - os.path.getmtime(path) > settle_s:
                os.unlink(path)
                removed.append(path)
    return removed


def cpu_shm_cleanup(before_init: bool) -> None:
    """vLLM-CPU's multi-rank communicator names its /dev/shm buffers after the group only (`...-[0-1]-cpushm_<r>`),
    the same in every run, and removes them only in C++ teardown: a killed run leaves them behind, and the next run
    then fails with "create shm in SHMManager failed. errno: 17". Before init we remove such files that no process
    maps; after init (every rank has joined every peer's buffer inside vLLM's init) we drop the names this process
    maps, so the memory goes with the last mapping and nothing is left behind, whatever happens later."""
    if before_init:
        remove_unmapped("/dev/shm/*-cpushm_*", settle_s=0.0)
        return
    for path in [p for p in _mapped_shm(["/proc/self/maps"]) if "-cpushm_" in p]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
