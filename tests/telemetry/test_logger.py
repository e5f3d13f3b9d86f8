"""Telemetry: JSONL always, TensorBoard and wandb (offline without a key, never a crash), console lines, timers."""

from __future__ import annotations

import math
import time

import pytest

from ds_rlhf.telemetry import MetricsLogger, PhaseTimer
from ds_rlhf.telemetry.logger import read_metrics


def test_jsonl_tensorboard_and_console_lines(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=4, desc="rl", postfix_keys=("reward/mean",), log_every=2,
                           progress=False)
    for step in range(1, 5):
        logger.log(step, {"reward/mean": step / 10, "bad": math.nan, "note": "not a number"})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["reward/mean"] == pytest.approx(0.3)
    assert records[0]["bad"] == "nan" and "note" not in records[0]  # non-finite kept visibly, text dropped
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "[rl] step 2/4  reward/mean 0.2" in out and "[rl] step 4/4  reward/mean 0.4" in out
    assert "step 1/4" not in out and "step 3/4" not in out


def test_only_rank_zero_writes(tmp_path):
    logger = MetricsLogger(tmp_path / "r1", rank=1, total_steps=2)
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "r1").exists()


@pytest.mark.slow
def test_wandb_without_a_key_runs_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = MetricsLogger(tmp_path, total_steps=2, wandb=True, tensorboard=False, progress=False,
                           config={"rl": {"algo": "grpo"}})
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert logger._wandb is not None, "wandb should have started in offline mode"
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert read_metrics(tmp_path)[0]["reward/mean"] == 0.5


def test_phase_timer():
    timer = PhaseTimer()
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("train"):
        time.sleep(0.01)
    with timer.phase("train"):
        time.sleep(0.01)
    out = timer.pop()
    assert out["time/rollout"] >= 0.02 and out["time/train"] >= 0.02
    assert out["time/step"] == pytest.approx(out["time/rollout"] + out["time/train"])
    assert timer.pop() == {"time/step": 0}


# ---- a torn last line never blocks a resume ----------------------------------------------------------------------
def _torn_log(path):
    path.mkdir(parents=True, exist_ok=True)
    whole = "".join(f'{{"step": {s}, "x": {s / 10}}}\n' for s in (1, 2, 3))
    (path / "metrics.jsonl").write_text(whole + '{"step": 4, "x": 0.')  # died (or the disk filled) mid-write
    return whole


def test_read_metrics_skips_a_torn_last_line_with_a_warning(tmp_path):
    _torn_log(tmp_path)
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_bad_line_before_the_end_is_an_error_naming_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2"):
        read_metrics(tmp_path)


def test_logger_appending_after_a_torn_line_keeps_the_log_readable(tmp_path):
    _torn_log(tmp_path)
    with pytest.warns(UserWarning, match="torn last line"):
        logger = MetricsLogger(tmp_path, total_steps=5, tensorboard=False, progress=False)
    logger.log(4, {"x": 0.4})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_truncate_metrics_drops_later_steps_and_a_torn_line_atomically(tmp_path, monkeypatch):
    from ds_rlhf.telemetry.logger import truncate_metrics

    whole = _torn_log(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", crash)  # the disk fills (or the process dies) before the rename
    with pytest.warns(UserWarning, match="torn"), pytest.raises(OSError):
        truncate_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # the old log is whole
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="torn"):
        assert truncate_metrics(tmp_path, 2) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(whole.splitlines(keepends=True)[:2])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left behind
