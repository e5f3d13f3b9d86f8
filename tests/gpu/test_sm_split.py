"""On a CUDA machine with `nvidia-cuda-mps-control`: `rollout.sm_split mps` (run/gpu_split.py) for real. A fresh
"trainer" process starts the split (engines 30%, trainer 70%), spawns an "engine" process with the split's engine
variables, and each initialises CUDA and reports the SMs it sees (`multi_processor_count`: an MPS client with an
active-thread percentage sees that share of the device's SMs; where a driver reports the whole device, the time
of a fixed matmul loop against the same loop outside the split shows the share instead); the device's full count
comes from a process outside the split. After the trainer exits, the guard has stopped the run's
daemon and removed its directory. Everything runs in child processes: this test process may hold a CUDA context
of its own already, and an MPS client must set its variables before CUDA starts. Prints the figures as one JSON
line. Run: `python -m pytest tests/gpu/test_sm_split.py -q -s`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA MPS needs an NVIDIA GPU"),
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                 reason="nvidia-cuda-mps-control is not on PATH")]

ROOT = Path(__file__).resolve().parents[2]
MPS_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")

# what each process runs once its variables are set: the SMs it sees and a timed bf16 matmul loop
MEASURE = textwrap.dedent("""
    import json, time, torch
    props = torch.cuda.get_device_properties(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    print(json.dumps({"sms": props.multi_processor_count, "matmul_s": time.perf_counter() - t0}), flush=True)
    """)

TRAINER = textwrap.dedent("""
    import json, subprocess, sys
    from ds_rlhf.config import parse_config
    from ds_rlhf.run.gpu_split import start_split
    cfg = parse_config(["--rollout.placement", "sidecar", "--rollout.sm_split", "mps",
                        "--rollout.engine_sm_percent", "30"], recipe="train-ppo")
    split = start_split(cfg, announce=lambda line: print(json.dumps({"line": line}), flush=True))
    print(json.dumps({"directory": split.directory}), flush=True)
    import os
    engine = subprocess.run([sys.executable, "-c", MEASURE], env=dict(os.environ, **split.engine_env()),
                            capture_output=True, text=True, timeout=300)
    assert engine.returncode == 0, engine.stderr[-3000:]
    print(json.dumps({"engine": json.loads(engine.stdout.strip().splitlines()[-1])}), flush=True)
    exec(MEASURE.replace("print(json.dumps(", "print(json.dumps({'trainer': ").replace("}), flush", "}}), flush"))
    """)


def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MPS_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def test_each_process_runs_on_its_share_and_the_daemon_stops_after_the_run():
    full = subprocess.run([sys.executable, "-c", MEASURE], env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    alone = json.loads(full.stdout.strip().splitlines()[-1])
    run = subprocess.run([sys.executable, "-c", f"MEASURE = {MEASURE!r}\n" + TRAINER], env=child_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out: dict = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            out.update(json.loads(line))
    total = alone["sms"]
    engine, trainer = out["engine"]["sms"], out["trainer"]["sms"]
    print(json.dumps({"device_sms": total, "engine_sms": engine, "trainer_sms": trainer, "alone_matmul_s":
                      alone["matmul_s"], "engine_matmul_s": out["engine"]["matmul_s"],
                      "trainer_matmul_s": out["trainer"]["matmul_s"], "line": out.get("line")}))
    if engine < total:  # the SM count shows the share (MPS rounds it to whole TPCs: a few SMs either way)
        assert abs(engine - 0.30 * total) <= 4, (engine, total)
        assert abs(trainer - 0.70 * total) <= 4, (trainer, total)
    else:  # a driver that reports the whole device: the matmul loop's time shows the share (1/0.3, 1/0.7 alone)
        assert out["engine"]["matmul_s"] > 2.0 * alone["matmul_s"], (out, alone)
        assert out["trainer"]["matmul_s"] > 1.2 * alone["matmul_s"], (out, alone)
    directory = Path(out["directory"])
    deadline = time.monotonic() + 150
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not directory.exists(), "the run's MPS daemon directory outlived the run (its guard did not stop it)"
