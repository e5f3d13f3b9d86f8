"""A rollout server process (`python -m ds_rlhf.rollout.server.server`), started before it is told to build an engine.

A new server spends its first seconds importing torch and vLLM (about 10 s on a 2-core CPU; the gap between one
sidecar engine being ready and the next one's first log line was about 20 s on the H200). It does that before it
connects back (`server._preload`), and the client accepts a server's connection only when that server's
turn comes, so `spawn_servers` starts every server of a sharded sidecar at once: they import side by side while
their engines are still built one after the other (vLLM sizes its KV cache from the device memory it measures while
it starts, so two engines must not start at the same time). Importing vLLM touches no device (it finds the GPU
through NVML, not CUDA).

`RemoteVLLMEngine(process=...)` takes a spawned process over (its listener, process and log file); without one it
spawns its own. Only trainer rank 0 runs servers: `spawn_servers` gives None to the other ranks.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Listener
from pathlib import Path

from ds_rlhf.distributed import clean_dist_env, world
from ds_rlhf.rollout.base import RolloutError


class ServerProcess:
    """The server process, the listener it connects back to (authenticated, on `host`) and its log file."""

    module = "ds_rlhf.rollout.server.server"  # what the process runs (`python -m`)

    def __init__(self, *, devices: Sequence[int] | None = None, log_path: str | None = None,
                 host: str = "127.0.0.1", extra_env: Mapping[str, str] | None = None) -> None:
        """`extra_env`: variables the server gets on top of this process's environment (the SM split's per-process
        share, `run/gpu_split.py`)."""
        authkey = secrets.token_bytes(16)
        self.listener = Listener((host, 0), authkey=authkey)
        root = str(Path(__file__).resolve().parents[2])
        env = clean_dist_env(DS_RLHF_ROLLOUT_ADDR=f"{host}:{self.listener.address[1]}",
                             DS_RLHF_ROLLOUT_KEY=authkey.hex(), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                             PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        env.update(extra_env or {})
        self.log, self.proc = None, None
        try:
            self.log = open(log_path, "ab") if log_path else None  # noqa: SIM115  closed in close()
            self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=env,
                                         stdout=self.log, stderr=subprocess.STDOUT if self.log else None)
        except BaseException:
            self.close()
            raise

    def connect(self, timeout: float):
        """The server's connection, once it made it; RolloutError if it dies first or takes over `timeout` s."""
        return _accept(self.listener, self.proc, timeout)

    def close(self) -> None:
        """Stop a server that no engine took over (idempotent; an engine that took it over closes it itself)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.listener.close()
        if self.log is not None:
            self.log.close()


def spawn_servers(n: int, *, devices: Sequence[int] | None = None, log_paths: Sequence[str | None] = (),
                  host: str = "127.0.0.1", extra_env: Mapping[str, str] | None = None) -> list[ServerProcess | None]:
    """`n` servers started at once on trainer rank 0 (None for each on other ranks, which run no server), each
    with `extra_env` on top of this process's environment."""
    if world()[0] != 0:
        return [None] * n
    log_paths = list(log_paths) or [None] * n
    out: list[ServerProcess | None] = []
    try:
        for i in range(n):
            out.append(ServerProcess(devices=devices, log_path=log_paths[i], host=host, extra_env=extra_env))
    except BaseException:
        for p in out:
            p.close()
        raise
    return out


def _accept(listener: Listener, proc: subprocess.Popen, timeout: float):
    """Accept the server's connection, giving up if it dies or takes longer than `timeout` seconds."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("conn", listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        thread.join(0.5)
        if proc.poll() is not None and thread.is_alive():
            raise RolloutError(f"rollout server exited with code {proc.returncode} before connecting")
        if time.monotonic() > deadline:
            raise RolloutError(f"rollout server did not connect within {timeout:.0f}s")
    if "conn" not in box:
        raise RolloutError("rollout server connection failed")
    return box["conn"]
