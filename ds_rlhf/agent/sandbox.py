"""Run one tool call in a separate, resource-limited process: a hang, a crash, a memory blow-up or megabytes of
output end that call with an observation saying so, never the episode runner.

What is enforced, per call (`Sandbox`):
- its own process (`subprocess`, a new session, started as `python -I sandbox_child.py` in a fresh temporary
  working directory that is removed afterwards);
- CPU time (`RLIMIT_CPU`: the kernel stops the process at `cpu_seconds`), address space (`RLIMIT_AS`:
  `memory_mb`; Python raises MemoryError, the call reports it) and written file size (`RLIMIT_FSIZE`);
- wall time: past `timeout_s` the whole process group is killed (SIGKILL);
- output: stdout and stderr (merged) and the returned value are kept up to `max_output_bytes` each; the rest is
  read and dropped, and the observation says how much was cut.

Environment: the process gets a minimal environment, not the trainer's: `PATH`, `LANG`, `HOME` and `TMPDIR` (both
the call's temporary directory), `PYTHONIOENCODING`, and `DS_RLHF_SANDBOX_NO_NETWORK` (below); no token, key or
other variable of the parent reaches it. `python -I` ignores `PYTHONPATH` and the user site; the tool's imports
come from the interpreter's own site-packages and the tool's file.

Network, with `no_network` (default): on Linux, where the kernel lets an unprivileged process create a user
namespace, the process moves into its own user and network namespace before the tool runs, so neither the tool
nor any program it starts can reach any address, the host's 127.0.0.1 included (`result.network ==
"namespace"`); Python's socket `connect`, `connect_ex`, `bind`, `sendto`, `socket.create_connection` and
`socket.getaddrinfo` also raise PermissionError. Where the kernel refuses (not Linux, user namespaces disabled,
a container's seccomp policy) only those Python functions are blocked (`result.network == "python"`): code that
starts another program, calls `_socket` or a C library directly gets through; run the trainer in a container
without a route out where that matters. `DS_RLHF_SANDBOX_NO_NETWORK` holds the mode in the process. The sandbox is
not a security boundary against hostile code in general: it is the same user on the same filesystem.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.config import ConfigError

CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class SandboxResult:
    """One call's outcome. `status`: "ok", "error" (the tool raised), "timeout" (killed at the wall timeout),
    "cpu_limit", "memory", "crashed" (the process died without a result). `output`: what it printed (cut at the
    limit), `value`: what it returned (as text), `dropped_bytes`: printed bytes past the limit. `network`: how the
    network was cut ("namespace" or "python", module docstring; "" with `no_network=False` or without a result)."""

    status: str
    value: str | None
    output: str
    error: str | None
    seconds: float
    dropped_bytes: int = 0
    returncode: int | None = None
    network: str = ""

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
    Python source (its printed output is the result)."""

    timeout_s: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 16_384
    file_mb: int = 64
    no_network: bool = True

    def call(self, fn: Callable, kwargs: dict) -> SandboxResult:
        path, name = tool_location(fn)
        return self._run({"mode": "call", "file": path, "name": name, "kwargs": kwargs})

    def run_code(self, code: str) -> SandboxResult:
        return self._run({"mode": "code", "code": code})

    def _run(self, job: dict) -> SandboxResult:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ds_rlhf_tool_", ignore_cleanup_errors=True) as work:
            result_path = os.path.join(work, ".ds_rlhf_result.json")
            job = {**job, "result_path": result_path, "cpu_seconds": self.cpu_seconds,
                   "memory_bytes": self.memory_mb << 20,
                   "file_bytes": max(self.file_mb << 20, 4 * self.max_output_bytes),
                   "max_output_bytes": self.max_output_bytes, "no_network": self.no_network}
            env = child_environment(work)
            try:
                blob = json.dumps(job).encode()
            except TypeError as exc:
                return SandboxResult("error", None, "", f"arguments are not JSON: {exc}", 0.0)
            proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work, env=env,
                                    start_new_session=True)
            kept, dropped, timed_out = self._talk(proc, blob, t0)
            seconds = time.monotonic() - t0
            output = kept.decode("utf-8", "replace")
            outcome = None
            if not timed_out and os.path.exists(result_path):
                try:
                    with open(result_path, encoding="utf-8") as f:
                        outcome = json.load(f)
                except (OSError, ValueError):
                    outcome = None
        rc = proc.returncode
        if timed_out:
            return SandboxResult("timeout", None, output, f"no result within the {self.timeout_s:g} s wall timeout "
                                 "(killed)", seconds, dropped, rc)
        if outcome is None:
            if rc == -signal.SIGXCPU:
                status, why = "cpu_limit", f"exceeded its CPU-time limit of {self.cpu_seconds} s (stopped)"
            else:
                status, why = "crashed", f"the process ended without a result (exit status {rc})"
            return SandboxResult(status, None, output, why, seconds, dropped, rc)
        status = outcome["status"]
        error = outcome.get("error")
        if status == "memory":
            error = f"ran out of memory (limit {self.memory_mb} MiB)"
        value = outcome.get("value")
        if value is not None and "value_chars" in outcome:
            dropped += int(outcome["value_chars"]) - len(value)
        return SandboxResult(status, value, output, error, seconds, dropped, rc, outcome.get("network", ""))

    def _talk(self, proc: subprocess.Popen, blob: bytes, t0: float) -> tuple[bytes, int, bool]:
        """Send the job, read the merged output until the process ends or the wall timeout passes (then kill its
        process group); keep `max_output_bytes`, count the rest."""
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(blob)
            proc.stdin.close()
        kept, dropped, timed_out = bytearray(), 0, False
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = self.timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(left, 0.5)):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                room = self.max_output_bytes - len(kept)
                kept += chunk[:max(room, 0)]
                dropped += max(len(chunk) - max(room, 0), 0)
        if timed_out:
            _kill_group(proc)
        try:
            proc.wait(timeout=max(self.timeout_s - (time.monotonic() - t0), 0) + 5)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            timed_out = True
        proc.stdout.close()
        return bytes(kept), dropped, timed_out


def child_environment(work: str) -> dict[str, str]:
    """The environment of a sandboxed call's process (module docstring): nothing else of the parent's."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": work,
            "TMPDIR": work, "PYTHONIOENCODING": "utf-8"}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


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
