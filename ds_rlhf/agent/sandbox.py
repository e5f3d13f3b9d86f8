"""Run one tool call in a separate, confined, resource-limited process: a hang, a crash, a memory blow-up,
megabytes of output or processes left behind end with that call, as an observation saying so, never the episode
runner; the result says which protections were active (`SandboxResult.protections`).

Per call (`Sandbox`), on Linux, each where the kernel allows it (`sandbox_confine.py` has the mechanisms):
- its own process in a new session (`python -I sandbox_child.py`, in a fresh temporary directory removed
  afterwards), in its own user, PID, network and mount namespaces (`pid_ns`, `net_ns`, `mount_ns`);
- killed whole (`kill`): at the wall timeout, as soon as the call's first process returns (what the tool left
  running, in any session or process group), and when the run ends (`sandbox_reap.stop_all`: the RL run's
  shut-down and interpreter exit); with a PID namespace the kernel kills the namespace when its init ends ("pid_ns"),
  else the call's pids cgroup ("cgroup", where this process may make one) or every process carrying the call's
  `DS_RLHF_SANDBOX_CALL` environment marker ("process_scan") is killed;
- at most `max_processes` processes (`nproc_limit`; a pids cgroup, or `RLIMIT_NPROC` in the user namespace, where
  the kernel counts the sandbox's processes only; without one it is set at the user's current count plus the cap,
  and the kernel does not apply it to root); a fork past it fails, an uncaught one ends the call "process_limit";
- writes only in the temporary directory (`fs_write: "tmpdir_only"`): every mount read-only in the mount namespace
  but a writable bind of that directory, and a Landlock ruleset (writing, making, removing, renaming files
  elsewhere refused, `/dev/null` and the like excepted);
- no socket of any family reaches anything: the network namespace has only its own loopback, which is down (not
  even the host's 127.0.0.1: `network: "namespace"`); a seccomp filter refuses `socket(AF_UNIX, ...)`, so Unix
  sockets on the filesystem are out of reach (`unix_sockets: "blocked"`; abstract ones belong to the network
  namespace), and refuses `io_uring_setup` and other ABIs' calls; without a network namespace it refuses
  `socket()` of every family (`network: "seccomp"`), else Landlock refuses TCP connect / bind (ABI 4,
  "landlock_tcp"), else only Python's socket functions refuse ("python"); `socketpair` stays. Python's socket
  `connect`, `connect_ex`, `bind`, `sendto`, `create_connection` and `getaddrinfo` raise PermissionError in every
  mode;
- no signal reaches the trainer or any process outside the call: the PID namespace shows none of them; without
  it, Landlock (ABI 6) refuses signals out of the sandbox;
- no capabilities (`capabilities: "dropped"`; the bounding set too, so no program it starts regains one);
- CPU time (`RLIMIT_CPU`: the kernel stops the process at `cpu_seconds`), address space per process (`RLIMIT_AS`:
  `memory_mb`; Python raises MemoryError, the call reports it) and written file size (`RLIMIT_FSIZE`);
- output: stdout and stderr (merged) and the returned value are kept up to `max_output_bytes` each; the rest is
  read and dropped, and the observation says how much was cut.

A protection the kernel refuses is a `RuntimeWarning` naming it and why (`SandboxResult.unavailable`), and the
fallback above takes its place; one named in `Sandbox.require` (or `env.sandbox_require`, "strict" = all of
`PROTECTIONS`) refuses the call instead (`SandboxUnprotected`, an error; the RL run checks at start).
`Sandbox.disable` turns mechanisms off for a tool that cannot run under them.

Environment: the process gets a minimal environment, not the trainer's: `PATH`, `LANG`, `HOME` and `TMPDIR` (both
the call's temporary directory), `PYTHONIOENCODING`, `DS_RLHF_SANDBOX_CALL` (the marker) and
`DS_RLHF_SANDBOX_NO_NETWORK` (the network mode); no token, key or other variable of the parent reaches it.
`python -I` ignores `PYTHONPATH` and the user site; the tool's imports come from the interpreter's own
site-packages and the tool's file.

What does not hold: the tool runs as the same user and reads whatever the user can read (its files; without a
user namespace, when the user is not root, also the user's other processes' /proc entries, the trainer's
environment included: the tool's capabilities are dropped, which only shields a root trainer); without a PID
namespace or a cgroup, a process that drops the marker (exec with a fresh environment) survives the call; memory is
capped per process, not per call (`max_processes` x `memory_mb`); the kernel itself is trusted (a kernel exploit
gets out). It is a sandbox for model-written code on a machine you trust, not a boundary against code written to
attack the kernel: run the trainer in a container or VM without credentials where that matters.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ds_rlhf.agent.sandbox_reap import MARKER, LiveCall
from ds_rlhf.errors import ConfigError

CHILD = Path(__file__).with_name("sandbox_child.py")
RESULT = ".ds_rlhf_result.json"
# what `Sandbox.require` / `env.sandbox_require` can name (the keys of `SandboxResult.protections` they check)
PROTECTIONS = ("pid_ns", "net_ns", "mount_ns", "nproc_limit", "fs_write", "unix_sockets")
_DEFAULT_REQUIRE: list[tuple[str, ...]] = [()]


@dataclass(frozen=True)
class SandboxResult:
    """One call's outcome. `status`: "ok", "error" (the tool raised), "timeout" (killed at the wall timeout),
    "cpu_limit", "memory", "process_limit" (a fork failed at the process cap), "crashed" (the process died without a
    result), "killed" (`sandbox_reap.stop_all`: the run is ending). `output`: what it printed (cut at the limit),
    `value`: what it returned (as text), `dropped_bytes`: printed bytes past the limit. `network`: how the network
    was cut ("namespace", "seccomp", "landlock_tcp" or "python", module docstring; "" with `no_network=False` or
    without a result). `protections`: what was active (module docstring), `unavailable`: protection -> why not."""

    status: str
    value: str | None
    output: str
    error: str | None
    seconds: float
    dropped_bytes: int = 0
    returncode: int | None = None
    network: str = ""
    protections: dict = field(default_factory=dict)
    unavailable: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def truncated(self) -> bool:
        return self.dropped_bytes > 0

    def observation(self, tool: str) -> str:
        """The text the model sees for this call."""
        parts = []
        if self.output:
            parts.append(self.output.rstrip("\n"))
        if self.truncated:
            parts.append(f"[output truncated: {self.dropped_bytes} more bytes were dropped]")
        if self.status == "ok":
            if self.value is not None:
                parts.append(self.value)
            return "\n".join(parts) if parts else "(no output)"
        parts.append(f"[tool {tool} failed: {self.error}]")
        return "\n".join(parts)

    def report(self, tool: str) -> dict:
        """The per-episode report entry of a call that did not end cleanly (None-free, JSON-ready)."""
        return {"tool": tool, "status": self.status, "error": self.error or "", "seconds": round(self.seconds, 3),
                "dropped_bytes": self.dropped_bytes}


@dataclass(frozen=True)
class Sandbox:
    """Limits for each call; `call(fn, kwargs)` runs a module-level function of a `.py` file (that file is
    imported afresh in every call's process, under its limits: keep its imports light), `run_code(code)` executes
    Python source (its printed output is the result). `max_processes`: processes the call may have at once;
    `require`: protections (`PROTECTIONS`, or "strict" for all) whose absence refuses the call instead of a
    warning, None = the process default (`require_protections`, set by `env.sandbox_require`); `disable`:
    mechanisms not to use (`PROTECTIONS`, "seccomp", "landlock", "cgroup") for a tool that cannot run under them."""

    timeout_s: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 16_384
    file_mb: int = 64
    no_network: bool = True
    max_processes: int = 64
    require: str | tuple[str, ...] | None = None
    disable: tuple[str, ...] = ()

    def call(self, fn: Callable, kwargs: dict) -> SandboxResult:
        path, name = tool_location(fn)
        return self._run({"mode": "call", "file": path, "name": name, "kwargs": kwargs})

    def run_code(self, code: str) -> SandboxResult:
        return self._run({"mode": "code", "code": code})

    def _job(self, job: dict, work: str, call: LiveCall) -> dict:
        required = _DEFAULT_REQUIRE[0] if self.require is None else parse_require(self.require)
        unknown = sorted(set(self.disable) - {*PROTECTIONS, "seccomp", "landlock", "cgroup"})
        if unknown:
            raise ConfigError(f"Sandbox.disable: {unknown[0]!r} is not one of {', '.join(PROTECTIONS)}, seccomp, "
                              "landlock, cgroup")
        return {**job, "result_path": os.path.join(work, RESULT), "work": work, "cpu_seconds": self.cpu_seconds,
                "memory_bytes": self.memory_mb << 20, "file_bytes": max(self.file_mb << 20, 4 * self.max_output_bytes),
                "max_output_bytes": self.max_output_bytes, "no_network": self.no_network,
                "max_processes": self.max_processes, "require": list(required), "disable": list(self.disable),
                "parent_pid": os.getpid(), "cgroup": call.cgroup}

    def _run(self, job: dict) -> SandboxResult:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ds_rlhf_tool_", ignore_cleanup_errors=True) as work:
            try:
                blob = json.dumps(job).encode()
            except TypeError as exc:
                return SandboxResult("error", None, "", f"arguments are not JSON: {exc}", 0.0)
            call = LiveCall(self.max_processes, not {"cgroup", "nproc_limit"} & set(self.disable))
            outcome = None
            try:
                blob = json.dumps(self._job(job, work, call)).encode()
                call.proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work,
                                             env=child_environment(work, call.marker), start_new_session=True)
                kept, dropped, timed_out = self._talk(call, blob, t0)
                if not timed_out and not call.stopped:
                    outcome = _read_outcome(os.path.join(work, RESULT))
            finally:
                call.end(scan=not (outcome or {}).get("protections", {}).get("pid_ns"))
            seconds = time.monotonic() - t0
        return self._result(outcome, call, bytes(kept).decode("utf-8", "replace"), dropped, timed_out, seconds)

    def _result(self, outcome: dict | None, call: LiveCall, output: str, dropped: int, timed_out: bool,
                seconds: float) -> SandboxResult:
        rc = call.proc.returncode
        if call.stopped:
            return SandboxResult("killed", None, output, "killed: the run is ending", seconds, dropped, rc)
        if timed_out:
            return SandboxResult("timeout", None, output, f"no result within the {self.timeout_s:g} s wall timeout "
                                 "(killed)", seconds, dropped, rc)
        if outcome is None:
            if rc == -signal.SIGXCPU:
                status, why = "cpu_limit", f"exceeded its CPU-time limit of {self.cpu_seconds} s (stopped)"
            else:
                status, why = "crashed", f"the process ended without a result (exit status {rc})"
            return SandboxResult(status, None, output, why, seconds, dropped, rc)
        status, error = outcome["status"], outcome.get("error")
        protections, unavailable = outcome.get("protections", {}), outcome.get("unavailable", {})
        if status == "unprotected":
            raise SandboxUnprotected(f"the tool sandbox cannot give the required protections here: {error} "
                                     "(drop them from Sandbox.require / env.sandbox_require to run with a warning)")
        _warn(unavailable)
        if status == "memory":
            error = f"ran out of memory (limit {self.memory_mb} MiB)"
        elif status == "process_limit":
            error = f"hit its limit of {protections.get('nproc_limit') or self.max_processes} processes ({error})"
        value = outcome.get("value")
        if value is not None and "value_chars" in outcome:
            dropped += int(outcome["value_chars"]) - len(value)
        return SandboxResult(status, value, output, error, seconds, dropped, rc, protections.get("network", ""),
                             protections, unavailable)

    def _talk(self, call: LiveCall, blob: bytes, t0: float) -> tuple[bytearray, int, bool]:
        """Send the job, read the merged output until the call's first process ends (not until every process
        holding its output ends: a process the tool left behind is killed afterwards) or the wall timeout passes
        (then kill it whole); keep `max_output_bytes`, count the rest."""
        proc = call.proc
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(blob)
            proc.stdin.close()
        out = _Output(proc.stdout.fileno(), self.max_output_bytes)
        exited = _exit_watch(proc)
        with selectors.DefaultSelector() as sel:
            sel.register(out.fd, selectors.EVENT_READ)
            if exited is not None:
                sel.register(exited, selectors.EVENT_READ)
            try:
                while proc.poll() is None and not call.stopped:
                    left = self.timeout_s - (time.monotonic() - t0)
                    if left <= 0:
                        break
                    for key, _ in sel.select(timeout=min(left, 0.1 if exited is None else left)):
                        if key.fd == out.fd and not out.read():
                            sel.unregister(out.fd)
            finally:
                if exited is not None:
                    os.close(exited)
        timed_out = proc.poll() is None and not call.stopped
        call.kill(scan=timed_out)
        proc.wait()
        out.drain()
        proc.stdout.close()
        return out.kept, out.dropped, timed_out


class SandboxUnprotected(ConfigError):
    """A protection in `Sandbox.require` / `env.sandbox_require` is not available on this machine."""


class _Output:
    """The call's merged stdout / stderr: the first `limit` bytes kept, the rest counted."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd, self.limit, self.kept, self.dropped, self.eof = fd, limit, bytearray(), 0, False

    def read(self) -> bool:
        chunk = os.read(self.fd, 65536)
        self.eof = not chunk
        room = max(self.limit - len(self.kept), 0)
        self.kept += chunk[:room]
        self.dropped += max(len(chunk) - room, 0)
        return bool(chunk)

    def drain(self) -> None:
        """What is left in the pipe once its writers are gone (a survivor holding it open stops the read)."""
        while not self.eof and select.select([self.fd], [], [], 0.2)[0] and self.read():
            pass


def _exit_watch(proc: subprocess.Popen) -> int | None:
    """A pidfd readable when `proc` ends (Linux >= 5.3), else None (the caller polls)."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def _read_outcome(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _warn(unavailable: dict) -> None:
    """A warning per missing protection (Python shows each distinct one once)."""
    for name, why in unavailable.items():
        warnings.warn(f"tool sandbox: no {name} ({why})", RuntimeWarning, stacklevel=4)


def parse_require(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`Sandbox.require` / `env.sandbox_require` as protection names: "" = none, "strict" = all of
    `PROTECTIONS`, else a comma list (or sequence) of them."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names == ["strict"]:
        return PROTECTIONS
    unknown = [n for n in names if n not in PROTECTIONS]
    if unknown:
        raise ConfigError(f"sandbox protection {unknown[0]!r} is not one of {', '.join(PROTECTIONS)} (or strict)")
    return tuple(names)


def require_protections(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """Set the protections every `Sandbox` without its own `require` must have (`env.sandbox_require`); with any,
    check them now with one call, raising `SandboxUnprotected` where this machine cannot give them."""
    _DEFAULT_REQUIRE[0] = required = parse_require(value)
    if required:
        Sandbox(timeout_s=60).run_code("pass")
    return required


def child_environment(work: str, marker: str = "") -> dict[str, str]:
    """The environment of a sandboxed call's process (module docstring): nothing else of the parent's."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": work,
            "TMPDIR": work, "PYTHONIOENCODING": "utf-8", MARKER: marker}


def tool_location(fn: Callable) -> tuple[str, str]:
    """(file, name) of a module-level function of a `.py` file: what the sandbox's process loads and calls."""
    name = getattr(fn, "__name__", None)
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        path = None
    if not path or not name or "<locals>" in getattr(fn, "__qualname__", "<locals>") or \
            getattr(fn, "__qualname__", "") != name:
        raise ConfigError(f"tool {name or fn!r} cannot run in the sandbox: a sandboxed tool must be a module-level "
                          "function of a .py file (the sandbox's process loads it by file path)")
    return str(Path(path).resolve()), name
