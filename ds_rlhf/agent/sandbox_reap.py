"""The trainer's side of killing a sandboxed call whole: each call in flight is registered with the ways to find
its processes (its process group; a pids cgroup of its own where this process may make one; an environment marker
every process of the call inherits), and is killed at its deadline, when it ends (whatever it left running), and
when the run ends (`stop_all`: the RL recipe's shut-down, and `atexit`).

With a PID namespace (`sandbox_child.py`) the kernel kills the call's processes when the namespace's init ends;
what is here is for the processes of a call without one, and for the call's first process.

A call's cgroup is `ds_rlhf_sandbox_<trainer pid>-<n>-<random>` under this process's own pids cgroup, with
`pids.max` = the call's `max_processes`; it is removed when the call ends, and the first call of a later trainer
removes the empty ones of trainers that are gone (a SIGKILLed trainer leaves its own).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import secrets
import signal
import subprocess
import threading
import time

MARKER = "DS_RLHF_SANDBOX_CALL"
_live: dict[str, LiveCall] = {}
_lock = threading.Lock()
_count = itertools.count()
_cgroup_base: list[str | None] = []


def _pids_cgroup_base() -> str | None:
    """The directory of this process's own pids cgroup when it may make cgroups under it (cgroup v1 `pids`
    hierarchy, or v2 with the pids controller), else None. Looked up once."""
    if _cgroup_base:
        return _cgroup_base[0]
    base = None
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
                if kind == "cgroup" and "pids" in options and "pids" in own:
                    path = fields[4] + own["pids"]
                elif kind == "cgroup2" and "" in own:
                    path = fields[4] + own[""]
                else:
                    continue
                if os.access(path, os.W_OK):
                    base = path
                    break
    except (OSError, ValueError):
        base = None
    _cgroup_base.append(base)
    if base is not None:
        _remove_stale_cgroups(base)
    return base


def _remove_stale_cgroups(base: str) -> None:
    """Remove the empty cgroups of sandboxed calls whose trainer is gone (a killed process leaves its own)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid = name.removeprefix("ds_rlhf_sandbox_").split("-")[0]
            if name.startswith("ds_rlhf_sandbox_") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(base, name))


def _make_cgroup(name: str, max_processes: int) -> str:
    base = _pids_cgroup_base()
    if base is None:
        return ""
    path = os.path.join(base, name)
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_processes))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return ""
    return path


def _cgroup_members(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs"), encoding="utf-8") as f:
            return [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def marked_processes(marker: str) -> list[int]:
    """The processes whose environment holds `MARKER=marker...` (a prefix), this process excluded."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if any(item.startswith(needle) for item in env.split(b"\0")):
            found.append(int(entry))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class LiveCall:
    """One sandboxed call in flight. `marker`: the value of `MARKER` in its environment; `cgroup`: its pids
    cgroup's directory ("" = none)."""

    def __init__(self, max_processes: int, use_cgroup: bool) -> None:
        self.marker = f"{os.getpid()}-{next(_count)}-{secrets.token_hex(4)}"
        self.cgroup = _make_cgroup(f"ds_rlhf_sandbox_{self.marker}", max_processes) if use_cgroup else ""
        self.proc: subprocess.Popen | None = None
        self.stopped = False  # killed by `stop_all`
        with _lock:
            _live[self.marker] = self
        _register_exit_hooks()

    def kill(self, scan: bool = True) -> None:
        """SIGKILL the call's process group, every process of its cgroup and (`scan`) every process carrying its
        marker, until none is found."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(100):
            pids = _cgroup_members(self.cgroup) if self.cgroup else []
            pids += marked_processes(self.marker) if scan else []
            if not pids:
                return
            _kill_all(pids)
            time.sleep(0.01)

    def end(self, scan: bool = True) -> None:
        """Kill what the call left running, remove its cgroup, forget it."""
        self.kill(scan)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait()
        self.remove_cgroup()
        with _lock:
            _live.pop(self.marker, None)

    def remove_cgroup(self) -> None:
        for _ in range(100 if self.cgroup else 0):
            try:
                os.rmdir(self.cgroup)
                return
            except FileNotFoundError:
                return
            except OSError:
                _kill_all(_cgroup_members(self.cgroup))
                time.sleep(0.01)


def stop_all() -> int:
    """Kill every sandboxed call of this process still in flight (their calls then end "killed") and remove their
    cgroups; how many."""
    with _lock:
        calls = list(_live.values())
    for call in calls:
        call.stopped = True
        call.kill()
        if call.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                call.proc.wait(5)
        call.remove_cgroup()
    return len(calls)


_hooks: list[bool] = []


def _register_exit_hooks() -> None:
    """`stop_all` at interpreter exit: with `atexit`, and before the interpreter waits for its worker threads
    (threading's own exit hooks run first, in reverse order of registration: registered at the first call, after
    concurrent.futures' own)."""
    with _lock:
        if _hooks:
            return
        _hooks.append(True)
    atexit.register(stop_all)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):
            register(stop_all)
