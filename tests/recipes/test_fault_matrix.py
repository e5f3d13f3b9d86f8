"""The fault matrix on the tiny model, run as a user runs it (`python launch/train_ppo.py`, fresh processes):
a second run on a busy directory is refused; SIGTERM saves a checkpoint and exits 143; a torn last metrics line
does not block the resume; a corrupted weights file is reported by name instead of resumed. (kill -9 at the
save points: test_rl_e2e.py; disk full: test_run_safety.py, on a small tmpfs when root.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.test_rl_e2e import rl_args

ROOT = Path(__file__).resolve().parents[2]
# HF generation: the faults are the run directory's, not the rollout engine's, and each of the four processes is
# spared vLLM's import and start (kill -9 with vLLM, in both modes: test_rl_e2e.py)
HF = ["--rollout.backend", "hf"]


def _launch(args, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115  closed by the caller's process exit
    return subprocess.Popen([sys.executable, str(ROOT / "launch" / "train_ppo.py"), *args], cwd=ROOT,
                            env=clean_env(PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(predicate, proc, log: Path, timeout: float = 600):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_busy_dir_sigterm_torn_metrics_and_corrupt_weights(sft_run, addition_stores, tmp_path):
    run, model = tmp_path / "run", sft_run[0] / "export"
    # steps enough that the SIGTERM below lands mid-run even when the refused second run is slow to start
    args = rl_args(run, model, addition_stores, steps=400, extra=[*HF, "--run.save_every", "0"])
    first = _launch(args, tmp_path / "first.log")
    _wait_for(lambda: _logged_steps(run) >= 2, first, tmp_path / "first.log")

    # two runs on one directory: the second is refused, naming the holder, while the first goes on
    second = subprocess.run([sys.executable, str(ROOT / "launch" / "train_ppo.py"), *args, "--run.resume", "latest"],
                            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr, second.stderr[-2000:]
    assert first.poll() is None

    # SIGTERM: the step in progress finishes, a checkpoint is saved, exit 128 + 15
    first.send_signal(signal.SIGTERM)
    assert first.wait(300) == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()[-3000:]
    steps = [r["step"] for r in read_metrics(run)]
    saved = sorted((run / "checkpoints").glob("step_*"))
    assert saved and saved[-1].name == f"step_{steps[-1]:08d}" and (saved[-1] / "COMPLETE").exists()
    assert "checkpoint saved; exiting with 143" in (tmp_path / "first.log").read_text()

    # a torn last line (a crash mid-write) does not block the resume, and the log continues where it stopped
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "reward/me')
    done = steps[-1] + 2
    resume = rl_args(run, model, addition_stores, steps=done, extra=[*HF, "--run.save_every", "0", "--run.resume",
                                                                      "latest"])
    resumed = _launch(resume, tmp_path / "resumed.log")
    assert resumed.wait(600) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, done + 1))

    # flipped bytes in the newest checkpoint's weights: the resume fails, naming the file; nothing is loaded
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    marker = json.loads((newest / "COMPLETE").read_text())
    weights = max((newest / name for name in marker["files"]), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = os.urandom(4096)
    weights.write_bytes(bytes(data))
    bad = subprocess.run([sys.executable, str(ROOT / "launch" / "train_ppo.py"),
                          *rl_args(run, model, addition_stores, steps=done + 1, extra=[*HF, "--run.resume", "latest"])],
                         cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0
    assert weights.name in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
