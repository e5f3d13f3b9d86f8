"""One `ds-rlhf autotune` trial: a short training run in its own process group, killed at its deadline, and its
status and throughput (the median over its steps after the first) read from its metrics.jsonl, status.json and log.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.distributed import clean_dist_env
from ds_rlhf.run.monitor import is_oom, read_status
from ds_rlhf.telemetry.logger import read_metrics

OBJECTIVES = {"completions": "throughput/completions_per_s", "tokens": "throughput/tokens_per_s"}


@dataclass
class Trial:
    index: int
    knobs: dict  # every searched knob's value in this trial
    changed: str  # the knob this trial changed ("" for the baseline)
    status: str = "pending"  # ok | oom | failed | timeout | invalid | no-metrics | skipped (does not fit the cap)
    seconds: float = 0.0
    objective: float | None = None
    completions_per_s: float | None = None
    tokens_per_s: float | None = None
    steps_measured: int = 0
    exit_code: int | None = None
    error: str = ""
    run_dir: str = ""
    log: str = ""



def trainer_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", *argv]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def measure(run_dir: Path, objective: str, log_tail: str, exit_code: int) -> dict:
    """A finished trial's status and throughput, from its metrics.jsonl, status.json and log."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = [r for r in read_metrics(run_dir) if isinstance(r.get("time/wall"), int | float)]
    steady = records[1:] if len(records) >= 2 else records

    def median(key, fallback=None):
        values = [v for r in steady if isinstance(v := r.get(key, fallback(r) if fallback else None), int | float)]
        return statistics.median(values) if values else None

    completions = median(OBJECTIVES["completions"],
                         lambda r: r.get("rollout/samples", 0.0) / max(float(r["time/wall"]), 1e-9))
    out = {"completions_per_s": completions, "tokens_per_s": median(OBJECTIVES["tokens"]),
           "steps_measured": len(steady)}
    out["objective"] = out["completions_per_s" if objective == "completions" else "tokens_per_s"]
    status = read_status(run_dir) or {}
    error = status.get("error", {})
    if exit_code != 0 or status.get("status") == "failed":
        lines = [ln for ln in log_tail.strip().splitlines() if ln.strip()]
        message = f"{error.get('type')}: {error.get('message')}" if error else (lines[-1] if lines else "")
        oom = bool(error.get("oom")) or is_oom(log_tail)
        return {**out, "status": "oom" if oom else "failed", "error": message[:500], "objective": None}
    if out["objective"] is None:
        return {**out, "status": "no-metrics", "error": "the run wrote no step with throughput metrics"}
    return {**out, "status": "ok"}


def run_trial(trial: Trial, argv: list[str], run_dir: Path, log_path: Path, *, timeout: float, objective: str,
              command=trainer_command, keep_checkpoints: bool = False) -> Trial:
    """Run one trial in its own process group (killed at `timeout` seconds) and fill in its result."""
    trial.run_dir, trial.log = str(run_dir), str(log_path)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=clean_dist_env(PYTHONUNBUFFERED="1"))
        try:
            trial.exit_code = proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            trial.exit_code = proc.returncode
            trial.status, trial.error = "timeout", f"killed after {timeout:.0f}s: the budget ran out"
        except BaseException:  # Ctrl-C of the search: no orphaned trainer
            _kill_group(proc)
            raise
    trial.seconds = round(time.monotonic() - start, 2)
    if trial.status != "timeout":
        tail = log_path.read_text(errors="replace")[-20000:]
        for key, value in measure(run_dir, objective, tail, trial.exit_code).items():
            setattr(trial, key, value)
    if not keep_checkpoints:
        import shutil

        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return trial
