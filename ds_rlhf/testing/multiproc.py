"""Run a Python function in N local processes with the torch.distributed env vars set (gloo on CPU).

Tests of world size > 1 use this instead of the `deepspeed` launcher so failures surface as one readable error:
each worker's stdout/stderr is captured and a non-zero exit, or a timeout, raises with the worker's output tail.
Workers return JSON-serialisable results through files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ds_rlhf.distributed import clean_dist_env, free_port

__all__ = ["clean_env", "free_port", "run_workers"]

_WORKER = """
import importlib, json, os, sys
mod_name, fn_name = sys.argv[1].split(":")
kwargs = json.loads(sys.argv[2])
result = getattr(importlib.import_module(mod_name), fn_name)(**kwargs)
with open(os.environ["DS_RLHF_RESULT_FILE"], "w") as f:
    json.dump(result, f)
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown: C++ helper threads of DeepSpeed/gloo still alive at exit can abort the process
# ("terminate called without an active exception") after the work is done and its result written.
os._exit(0)
"""


# A child started with clean_env() sets up its own process group (a test session's group holds MASTER_PORT;
# inheriting it fails with EADDRINUSE).
clean_env = clean_dist_env


def run_workers(target: str, world_size: int, kwargs: dict | None = None, timeout: float = 600,
                env: dict | None = None) -> list:
    """Run `module:function(**kwargs)` on `world_size` ranks; return each rank's JSON result, rank order."""
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="ds_rlhf_mp") as tmp:
        procs = []
        for rank in range(world_size):
            wenv = dict(os.environ)
            wenv.update(env or {})
            wenv.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                        DS_RLHF_RESULT_FILE=str(Path(tmp) / f"result{rank}.json"),
                        PYTHONPATH=os.pathsep.join([str(root), wenv.get("PYTHONPATH", "")]))
            wenv.setdefault("DS_ACCELERATOR", "cpu")
            log = open(Path(tmp) / f"log{rank}.txt", "w+")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen([sys.executable, "-c", _WORKER, target, json.dumps(kwargs or {})],
                                           env=wenv, stdout=log, stderr=subprocess.STDOUT), log))
        failures = []
        for rank, (proc, log) in enumerate(procs):
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                rc = "timeout"
            if rc != 0:
                log.seek(0)
                failures.append(f"--- rank {rank} exited {rc}; output tail:\n{log.read()[-4000:]}")
            log.close()
        if failures:
            raise RuntimeError(f"{target} failed on {len(failures)} of {world_size} ranks\n" + "\n".join(failures))
        return [json.loads((Path(tmp) / f"result{r}.json").read_text()) for r in range(world_size)]
