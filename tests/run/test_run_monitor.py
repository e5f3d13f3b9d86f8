"""RunMonitor: status.json (running -> finished / failed / stopped), environment.json, health warnings printed once
with a count metric, and the metrics endpoint fed and closed."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.distributed import free_port
from ds_rlhf.run.monitor import RunMonitor, exit_status, is_oom, read_status


def _cfg(tmp_path, *extra):
    return parse_config(["--run.output_dir", str(tmp_path), *extra])


def _monitor(tmp_path, *extra, active=True, environment=False, printed=None):
    printer = printed.append if printed is not None else (lambda text: None)
    monitor = RunMonitor(_cfg(tmp_path, *extra), tmp_path, is_main=active, kind="rl", total_steps=30,
                         print_fn=printer, environment=environment)
    monitor.start()
    return monitor


def rec(wall=1.0, rollout=0.6, train=0.3, gpu=90.0):
    return {"time/rollout": rollout, "time/train": train, "time/sync": 0.05, "time/data": 0.01, "time/wall": wall,
            "throughput/tokens_per_s": 1000.0 / wall, "sys/gpu_util_pct": gpu}


@pytest.mark.parametrize("exc, status, extra", [
    (None, "finished", {"exit_code": 0}),
    (SystemExit(128 + signal.SIGTERM), "stopped", {"signal": "SIGTERM", "exit_code": 143}),
    (KeyboardInterrupt(), "stopped", {"signal": "SIGINT"}),
    (SystemExit(0), "finished", {}),
])
def test_exit_status_of_a_finished_or_stopped_run(exc, status, extra):
    out = exit_status(exc)
    assert out["status"] == status and extra.items() <= out.items()


def test_exit_status_of_a_failed_run_names_the_error_and_oom():
    try:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except RuntimeError as exc:
        out = exit_status(exc)
    assert out["status"] == "failed" and out["exit_code"] == 1
    assert out["error"]["type"] == "RuntimeError" and "Tried to allocate" in out["error"]["message"]
    assert out["error"]["oom"] and "raise RuntimeError" in out["error"]["traceback"]
    assert not exit_status(ValueError("bad row"))["error"]["oom"]
    assert is_oom("torch.OutOfMemoryError: ...") and is_oom("ValueError: No available memory for the cache blocks")


def test_status_json_running_then_finished(tmp_path):
    monitor = _monitor(tmp_path)
    status = read_status(tmp_path)
    assert status["status"] == "running" and status["kind"] == "rl" and status["total_steps"] == 30
    monitor.finish(None, step=30)
    monitor.finish(RuntimeError("later calls do nothing"), step=31)
    status = read_status(tmp_path)
    assert status["status"] == "finished" and status["step"] == 30 and status["health_warnings"] == 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_status_json_failed(tmp_path):
    monitor = _monitor(tmp_path)
    monitor.finish(MemoryError("cannot allocate memory"), step=4)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["error"]["type"] == "MemoryError" and status["error"]["oom"]


def test_other_ranks_write_nothing(tmp_path):
    monitor = _monitor(tmp_path, "--run.metrics_port", str(free_port()), active=False)
    assert monitor.after_step(1, {"time/wall": 1.0}) == {"time/wall": 1.0} and monitor.exporter is None
    monitor.finish(None, step=1)
    assert list(tmp_path.iterdir()) == []


def test_environment_json_is_the_doctors_json(tmp_path):
    _monitor(tmp_path, environment=True)
    env = json.loads((tmp_path / "environment.json").read_text())
    names = {c["name"] for c in env["checks"]}
    assert {"GPUs", "vLLM", "data dir I/O"} <= names and "ok" in env and env["seconds"] < 60


def test_each_new_health_warning_is_printed_once_with_its_cause(tmp_path):
    printed: list[str] = []
    monitor = _monitor(tmp_path, printed=printed)
    steps = [rec() for _ in range(8)] + [rec(wall=2.0, rollout=1.6)] * 3 + [rec()] * 2 + [rec(wall=2.0, rollout=1.6)]
    counts = [monitor.after_step(i + 1, m)["health/warnings"] for i, m in enumerate(steps)]
    assert counts[:8] == [0.0] * 8
    assert counts[8] >= 1 and counts[11] == 0.0
    slow = [line for line in printed if "took" in line]
    # step 9 starts the slowdown (printed), steps 10-11 continue it (not printed: the median catches up, or it is
    # the same warning), step 12 is back to normal; step 14's new slowdown is printed again
    assert slow[0].startswith("[health] step 9 took 2.00s") and "rollout-bound" in slow[0]
    assert len([line for line in slow if "step 10 " in line or "step 11 " in line]) == 0
    assert any(line.startswith("[health] step 14 took") for line in slow)
    monitor.finish(None, step=14)
    assert read_status(tmp_path)["health_warnings"] == monitor.warnings_raised >= 2


def test_a_policy_collapse_is_printed_once_and_kept_in_status_json(tmp_path):
    """Every group's rewards equal for run.health_collapse_steps steps after steps with a spread: one line in the
    log, the same in status.json's `health` while running and after the run."""
    printed: list[str] = []
    monitor = _monitor(tmp_path, "--run.health_collapse_steps", "4", printed=printed)
    spread = {**rec(), "reward/mean": 0.3, "reward/std": 0.3, "reward/frac_zero_std": 0.25}
    flat = {**rec(), "reward/mean": 0.1, "reward/std": 0.0, "reward/frac_zero_std": 1.0}
    for step in range(1, 4):
        monitor.after_step(step, spread)
    for step in range(4, 12):  # flat from step 4: four flat steps at step 7, still flat after
        monitor.after_step(step, flat)
        if step == 6:
            assert read_status(tmp_path)["health"] == []
    monitor.after_step(12, spread)
    for step in range(13, 18):  # flat again: the collapse was named already
        monitor.after_step(step, flat)
    lines = [line for line in printed if "collapse" in line]
    assert len(lines) == 1 and lines[0].startswith("[health] policy collapse at step 7: in each of the last 4 steps")
    status = read_status(tmp_path)
    assert status["status"] == "running"
    assert status["health"] == [{"kind": "flat_rewards", "step": 7, "message": lines[0].removeprefix("[health] ")}]
    monitor.finish(None, step=17)
    status = read_status(tmp_path)
    assert status["status"] == "finished" and [h["step"] for h in status["health"]] == [7]


def test_health_off_adds_no_metric(tmp_path):
    monitor = _monitor(tmp_path, "--run.health_warnings", "false")
    assert "health/warnings" not in monitor.after_step(1, rec())


def test_metrics_endpoint_is_fed_and_closed_at_finish(tmp_path):
    port = free_port()
    monitor = _monitor(tmp_path, "--run.metrics_port", str(port))
    assert monitor.exporter is not None and monitor.exporter.active
    monitor.after_step(7, {**rec(), "reward/mean": 0.75})
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "ds_rlhf_step 7.0" in text and "ds_rlhf_reward_mean 0.75" in text
    monitor.finish(None, step=7)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_report_status_reads_status_json(tmp_path):
    from ds_rlhf.ops.report import run_status

    monitor = _monitor(tmp_path)
    assert run_status(tmp_path, [{"step": 3}], {"run": {"steps": 10}}, []).startswith("stopped at step 3 of 10 without")
    try:
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
    except RuntimeError as exc:
        monitor.finish(exc, step=3)
    said = run_status(tmp_path, [{"step": 3}], {"run": {"steps": 10}}, [2])
    assert said.startswith("failed at step 3 (out of memory): RuntimeError: CUDA out of memory") and "step 2" in said


def test_metrics_endpoint_binds_run_metrics_host(tmp_path, monkeypatch):
    monkeypatch.delenv("DS_RLHF_METRICS_ADDR", raising=False)
    for extra, bound in (((), "127.0.0.1"), (("--run.metrics_host", "0.0.0.0"), "0.0.0.0")):
        monitor = _monitor(tmp_path, "--run.metrics_port", str(free_port()), *extra)
        try:
            assert monitor.exporter.active and monitor.exporter._server.server_address[0] == bound
        finally:
            monitor.finish(None, step=0)
