"""Exact resume of an episode run (`env.name`) killed with SIGKILL while a step's episodes are being played:
every logged metric of every step (the wall-time ones aside) and the sample log's transcripts equal those of an
uninterrupted run with the same seed, bit for bit. The environment's steps take a random while (OS-seeded jitter,
`paced_calculator.py`), so the episodes' steps finish in a different order in every run: the batch must not depend
on it. Each run is a fresh process (`episode_run.py`: the tiny HF engine, episodes' first turn a forced calculator
call), as a user's run is."""

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
from ds_rlhf.telemetry.samples import read_samples
from ds_rlhf.testing.multiproc import clean_env
from tests.agent.paced_calculator import STEP_MARKER
from tests.agent.test_rl_episodes import episode_args

ROOT = Path(__file__).resolve().parents[2]
PACED = f"{Path(__file__).parent / 'paced_calculator.py'}:PacedCalculatorEnv"
STEPS, SAVE_AT = 4, 2


def not_the_computation(key: str) -> bool:
    """Metrics that measure the clock or the machine, not the computation; and `health/warnings`, the count of
    the operator's warnings, which read the steps this process has seen (a resumed process starts with none)."""
    return (key in ("time", "health/warnings") or key.startswith(("time/", "throughput/", "sys/"))
            or key.endswith(("seconds", "_per_s", "gbps")))


def run_args(model, store, out, extra=()):
    args = episode_args(model, store, out, STEPS)
    args[args.index("--env.name") + 1] = PACED
    return [*args, "--run.save_every", str(SAVE_AT), "--run.sample_log_every", "1", *extra]


def launch(args, log: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.agent.episode_run", *args], cwd=ROOT,
                            env=clean_env(PYTHONUNBUFFERED="1", **env), stdout=open(log, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)


def run_to_end(args, log: Path) -> None:
    proc = launch(args, log)
    assert proc.wait(900) == 0, log.read_text()[-3000:]


def marker_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_mid_episode_batch_then_resume_is_exact(mode, tiny_model_path, arithmetic_store, tmp_path):
    extra = ["--rollout.async_generation", "true", "--rl.mismatch", "tis"] if mode == "async" else []
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_to_end(run_args(tiny_model_path, arithmetic_store, straight, extra), tmp_path / "straight.log")

    # the same run, its environment's steps marked: killed once episodes are being played after step 2's checkpoint
    marker, log = tmp_path / "steps.txt", tmp_path / "killed.log"
    proc = launch(run_args(tiny_model_path, arithmetic_store, killed, extra), log, **{STEP_MARKER: str(marker)})
    saved = killed / "checkpoints" / f"step_{SAVE_AT:08d}" / "COMPLETE"
    deadline = time.time() + 900
    while not saved.exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    before = marker_lines(marker)
    while marker_lines(marker) <= before:  # an episode's step has begun (it sleeps a second once marked)
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [r["step"] for r in read_metrics(killed)]
    assert done[-1] < STEPS, f"the run finished before the kill: {done}"

    run_to_end(run_args(tiny_model_path, arithmetic_store, killed, [*extra, "--run.resume", "latest"]),
               tmp_path / "resumed.log")
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    a, b = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert min(r["episode/turns_mean"] for r in a) >= 2  # every episode called the calculator, then went on
    # the same metrics, but: a batch restored from a checkpoint has no generation timing, and the resumed process
    # hands its weights to the engine at start, so the report of a weight hand-over (`sync/...`) may sit elsewhere
    computed = [[{k for k in r if not not_the_computation(k) and not k.startswith("sync/")} for r in run]
                for run in (a, b)]
    assert computed[0] == computed[1]
    differ = {(ra["step"], k): (ra[k], rb[k]) for ra, rb in zip(a, b) for k in ra
              if not not_the_computation(k) and k in rb and ra[k] != rb[k]}
    assert not differ
    sa, sb = read_samples(straight), read_samples(killed)
    assert [s["step"] for s in sa] == [s["step"] for s in sb] == [s for s in range(1, STEPS + 1) for _ in range(4)]
    assert all(s["turns"] and s["tool_calls"] >= 1 for s in sa)
    assert json.dumps(sa, sort_keys=True) == json.dumps(sb, sort_keys=True)
