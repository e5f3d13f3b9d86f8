"""The guard of a run's private CUDA MPS control daemon (`run/gpu_split.py`), a process of its own:
`python -m ds_rlhf.run.mps_guard CONTROL DIRECTORY`.

It reads its stdin until it closes: the run closed its split, or the run's process ended, however it ended (an
exception, a signal, SIGKILL: the kernel closes the pipe). Then it sends the daemon `quit` through CONTROL (the
`nvidia-cuda-mps-control` the daemon was started with) with the run's pipe and log directories, waits for the
daemon to go (it waits for its clients to finish first) and removes DIRECTORY. It runs in a session of its own,
so a Ctrl-C to the run's terminal does not stop it before the daemon is told to quit. Imports the standard library
only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"  # what the control daemon writes in its pipe directory


def mps_env(directory: str | os.PathLike) -> dict[str, str]:
    """The variables that point a CUDA process (client, daemon or control command) at the run's daemon."""
    directory = Path(directory)
    return {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}


def quit_daemon(control: str, directory: str | os.PathLike, *, wait_s: float = 120.0) -> int:
    """Tell the daemon to quit, wait up to `wait_s` for its process to end, remove `directory`; the control
    command's exit status."""
    env = dict(os.environ, **mps_env(directory))
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    try:
        rc = subprocess.run([control], input=b"quit\n", env=env, capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        rc = -1
    pid_file = Path(mps_env(directory)["CUDA_MPS_PIPE_DIRECTORY"]) / PID_FILE
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _alive(pid_file):
        time.sleep(0.2)
    shutil.rmtree(directory, ignore_errors=True)
    return rc


def _alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def main(argv: list[str]) -> int:
    control, directory = argv
    while sys.stdin.buffer.read(4096):
        pass
    quit_daemon(control, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
