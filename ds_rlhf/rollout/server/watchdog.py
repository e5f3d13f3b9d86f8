"""A watchdog for a call that has no timeout of its own: vLLM's NCCL weight transfer to a disaggregated server.

vLLM's NCCL group (a `PyNcclCommunicator` over a stateless store) sets no timeout: a trainer inside its rendezvous
or a broadcast waits for the server's workers forever, even after the server process died, and nothing can raise
into that wait. `exit_if_server_fails` watches the server processes from a thread while the call runs; when one of
them exits, or the call outlasts `timeout_s`, it writes one line naming the server, its exit code or the time, and
the way to resume, then ends this process (exit code 1), as torch's own NCCL watchdog does. The run's last
checkpoint is intact; `--run.resume latest` continues from it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

EXIT_CODE = 1


def failure(processes: Sequence[subprocess.Popen], started: float, timeout_s: float) -> str | None:
    """Why the call cannot finish (a server exited, or the call outlasted `timeout_s`), or None."""
    for proc in processes:
        if proc.poll() is not None:
            return f"the rollout server (pid {proc.pid}) exited with code {proc.returncode}"
    if time.monotonic() - started > timeout_s:
        return f"the rollout server did not finish it within {timeout_s:.0f}s"
    return None


@contextlib.contextmanager
def exit_if_server_fails(processes: Sequence[subprocess.Popen], timeout_s: float, what: str, *,
                         poll_s: float = 1.0, exit: Callable[[int], object] = os._exit) -> Iterator[None]:
    """Run the body with the watchdog on: if a process in `processes` exits or `timeout_s` passes before the body
    returns, write the one-line error to stderr, then `exit(EXIT_CODE)` (by default `os._exit`, as the
    body is stuck where no exception can reach it)."""
    done, started = threading.Event(), time.monotonic()

    def watch() -> None:
        while not done.wait(poll_s):
            reason = failure(processes, started, timeout_s)
            if reason is not None and not done.is_set():
                line = (f"error: {what}: {reason} while this process waited inside vLLM's NCCL weight transfer, "
                        "which has no timeout; exiting so the run does not hang (the last checkpoint is intact: "
                        "resume with --run.resume latest)")
                print(line, file=sys.stderr, flush=True)
                exit(EXIT_CODE)
                return

    watcher = threading.Thread(target=watch, name="ds_rlhf-nccl-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
