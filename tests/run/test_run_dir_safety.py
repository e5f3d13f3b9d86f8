"""The run directory under misuse: a fresh run in an old run's directory is refused (or `--run.overwrite` clears
it, and leftover metrics are set aside), a second run on the same directory is refused while the first holds its
lock, and a bad `--run.resume` path fails in one line. setup_run on the tiny model's tokenizer; checkpoints of
small fake engines (fake_checkpoints.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.fake_checkpoints import checkpoint_manager, run_config, save_steps

ROOT = Path(__file__).resolve().parents[2]


# ---- 1: a fresh run in an old run's directory -------------------------------------------------------------------
def test_1_fresh_run_into_a_directory_with_checkpoints_is_refused(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run

    save_steps(tmp_path, [7, 8])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 9)))
    (tmp_path / "config.json").write_text('{"old": true}')
    with pytest.raises(Exception) as info:
        setup_run(run_config(tiny_model_path, tmp_path), "rl")
    from ds_rlhf.run.run_dir import RunDirError

    assert isinstance(info.value, RunDirError)
    message = str(info.value)
    assert str(tmp_path) in message and "step_00000008" in message
    assert "--run.resume latest" in message and "--run.overwrite true" in message
    assert json.loads((tmp_path / "config.json").read_text()) == {"old": True}  # nothing written
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8


def test_1_overwrite_removes_the_old_checkpoints_and_metrics(tiny_model_path, dist_single, tmp_path, capsys):
    from ds_rlhf.run.context import setup_run

    save_steps(tmp_path, [7, 8])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 8}) + "\n")
    ctx = setup_run(run_config(tiny_model_path, tmp_path, "--run.overwrite", "true"), "rl")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    out = capsys.readouterr().out
    assert "--run.overwrite: removed" in out and "step_00000008" in out
    ctx.close()


def test_1_leftover_metrics_without_checkpoints_are_set_aside(tiny_model_path, dist_single, tmp_path, capsys):
    from ds_rlhf.run.context import setup_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    ctx = setup_run(run_config(tiny_model_path, tmp_path), "rl")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert len(list(tmp_path.glob("metrics.before-*.jsonl"))) == 1
    assert "moved to metrics.before-" in capsys.readouterr().out
    ctx.close()


# ---- 3: two runs on one directory ---------------------------------------------------------------------------------
HOLD_LOCK = """
import sys, time
from ds_rlhf.run.run_dir import acquire_run_lock
acquire_run_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "locked" not in line:
        proc.kill()
        pytest.fail(f"lock holder did not start: {line}{proc.stdout.read()}")
    return proc


def test_3_second_run_on_the_same_directory_is_refused(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run
    from ds_rlhf.run.run_dir import RunDirError

    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirError, match="in use by another run") as info:
            setup_run(run_config(tiny_model_path, tmp_path), "rl")
        assert f"pid {holder.pid}" in str(info.value) and socket.gethostname() in str(info.value)
        assert not (tmp_path / "config.json").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    ctx = setup_run(run_config(tiny_model_path, tmp_path), "rl")  # a dead holder's lock is gone with it
    assert (tmp_path / ".lock").read_text().startswith(f"pid={os.getpid()}\n")
    ctx.close()
    holder = _holder(tmp_path)  # and close() gave it back
    holder.kill()
    holder.wait()


# ---- resume from a bad path -------------------------------------------------------------------------------------
def test_resume_from_a_bad_path_fails_in_one_line(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run

    bad = tmp_path / "nope" / "step_00000003"
    with pytest.raises(FileNotFoundError) as info:
        setup_run(run_config(tiny_model_path, tmp_path / "run", "--run.resume", str(bad)), "rl")
    assert str(info.value) == f"--run.resume {bad}: no such directory"
    with pytest.raises(FileNotFoundError, match="a run directory, not a checkpoint"):
        checkpoint_manager(tmp_path / "run").resolve(str(save_steps(tmp_path / "other", [1]).root.parent))
