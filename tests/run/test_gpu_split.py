"""`rollout.sm_split` (run/gpu_split.py, memory/sm_share.py): the settings' rules, the engines' share from the
planned work, the decision per machine, the run's MPS daemon started and stopped, and the share each spawned
process carries.

The daemon tests put a fake `nvidia-cuda-mps-control` on PATH (a script in a temp directory that records each
call: its arguments, its MPS variables and what it read on stdin) because the real binary needs an NVIDIA GPU and
driver; tests/gpu/test_sm_split.py runs the real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory.sm_share import MAX_PERCENT, MIN_PERCENT, PlannedWork, engine_sm_percent, planned_work
from ds_rlhf.rollout.server.process import ServerProcess, spawn_servers
from ds_rlhf.run import gpu_split
from ds_rlhf.run.gpu_split import PERCENT_VAR, Probe, decide_split, start_split
from ds_rlhf.testing import fake_mps
from ds_rlhf.testing.fake_mps import MPS_VARS, calls

BENCH = ["--rl.prompts_per_step", "32", "--rollout.n_samples", "8", "--rollout.max_new_tokens", "256",
         "--data.max_prompt_len", "128", "--rollout.placement", "sidecar"]


def cfg_of(*extra: str):
    return parse_config([*BENCH, *extra], recipe="train-ppo")


def machine(*, control="/usr/bin/nvidia-cuda-mps-control", mode="Default", initialised=False) -> Probe:
    return Probe(which=lambda name: control, compute_mode=lambda: mode, cuda_initialized=lambda: initialised,
                 green_missing=lambda: "torch.cuda.GreenContext is missing")


# ---- settings ------------------------------------------------------------------------------------------------------
def test_settings_rules():
    assert cfg_of().rollout.sm_split == "off"  # the default until measured
    with pytest.raises(ConfigError, match="rollout.engine_sm_percent=40.*sm_split=off"):
        cfg_of("--rollout.engine_sm_percent", "40")
    with pytest.raises(ConfigError, match="rollout.trainer_sm_percent=50"):
        cfg_of("--rollout.trainer_sm_percent", "50")
    with pytest.raises(ConfigError, match="rollout.sm_split=mps.*placement sidecar"):
        parse_config(["--rollout.sm_split", "mps"], recipe="train-ppo")
    with pytest.raises(ConfigError, match="engine_sm_percent"):
        cfg_of("--rollout.sm_split", "mps", "--rollout.engine_sm_percent", "101")
    with pytest.raises(ConfigError, match="sm_split"):
        cfg_of("--rollout.sm_split", "half")
    cfg = cfg_of("--rollout.sm_split", "auto", "--rollout.engine_sm_percent", "40")
    assert cfg.rollout.engine_sm_percent == 40
    assert parse_config(["--rollout.sm_split", "auto"], recipe="train-ppo").rollout.sm_split == "auto"  # may fall back


# ---- the share from the planned work -------------------------------------------------------------------------------
def test_engine_share_balances_the_two_phases_times():
    bench = planned_work(cfg_of())
    assert bench == PlannedWork(gen_tokens=32 * 8 * 256, train_tokens=32 * 8 * 384, passes=3.0)
    share = engine_sm_percent(bench)
    gen, train = bench.gen_tokens * 6.4, bench.train_tokens * 3.0
    assert share == round(100 * gen / (gen + train)) == 59
    longer = engine_sm_percent(PlannedWork(bench.gen_tokens * 2, bench.train_tokens, 3.0))
    heavier = engine_sm_percent(PlannedWork(bench.gen_tokens, bench.train_tokens, 6.0))
    assert longer > share > heavier  # more generation: more SMs to the engines; more training: fewer
    assert engine_sm_percent(PlannedWork(1, 10**9, 3.0)) == MIN_PERCENT
    assert engine_sm_percent(PlannedWork(10**9, 1, 3.0)) == MAX_PERCENT
    with pytest.raises(ValueError, match="positive"):
        engine_sm_percent(PlannedWork(0, 1, 3.0))


def test_planned_work_counts_every_pass_the_settings_add():
    assert planned_work(cfg_of("--model.gradient_checkpointing", "true")).passes == 4.0
    assert planned_work(cfg_of("--rl.kl_coef", "0.05")).passes == 4.0  # the reference's forward
    assert planned_work(cfg_of("--rl.ppo_epochs", "2")).passes == 7.0  # 2 epochs and the old log-probs
    assert planned_work(cfg_of("--rl.algo", "ppo")).passes == 6.0  # a critic's update too


# ---- the decision --------------------------------------------------------------------------------------------------
def test_decision_per_machine():
    assert decide_split(cfg_of()).mode == "off"
    mps = decide_split(cfg_of("--rollout.sm_split", "auto"), probe=machine())
    assert (mps.mode, mps.engine_percent, mps.trainer_percent) == ("mps", 59, 41)
    assert "from the planned work" in mps.line
    own = decide_split(cfg_of("--rollout.sm_split", "mps", "--rollout.engine_sm_percent", "35",
                              "--rollout.trainer_sm_percent", "80"), probe=machine())
    assert (own.engine_percent, own.trainer_percent) == (35, 80)
    for probe, why in [(machine(control=None), "not on PATH"), (machine(mode="Exclusive_Process"), "Exclusive"),
                       (machine(initialised=True), "already initialised")]:
        auto = decide_split(cfg_of("--rollout.sm_split", "auto"), probe=probe)
        assert auto.mode == "off" and auto.line.startswith("[sm_split] auto: time-slicing") and why in auto.line
        with pytest.raises(ConfigError, match=f"rollout.sm_split=mps: .*{why}"):
            decide_split(cfg_of("--rollout.sm_split", "mps"), probe=probe)
    ranks = decide_split(cfg_of("--rollout.sm_split", "auto"), world_size=2, probe=machine())
    assert ranks.mode == "off" and "2 training ranks" in ranks.line
    colocated = parse_config(["--rollout.sm_split", "auto"], recipe="train-ppo")
    assert "placement=colocated" in decide_split(colocated, probe=machine()).line
    with pytest.raises(ConfigError, match="sm_split=green: torch.cuda.GreenContext is missing"):
        decide_split(cfg_of("--rollout.sm_split", "green"), probe=machine())


def test_green_is_refused_naming_what_is_missing_with_the_installed_torch():
    with pytest.raises(ConfigError, match="rollout.sm_split=green: .*GreenContext") as info:
        decide_split(cfg_of("--rollout.sm_split", "green"))
    assert "\n" not in str(info.value)


def test_auto_falls_back_where_the_binary_is_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control anywhere
    said = []
    split = start_split(cfg_of("--rollout.sm_split", "auto"), announce=said.append)
    assert split.decision.mode == "off" and split.engine_env() == {}
    assert said == ["[sm_split] auto: time-slicing the GPU: nvidia-cuda-mps-control is not on PATH"]
    assert PERCENT_VAR not in os.environ
    split.close()


# ---- the daemon ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """A fake `nvidia-cuda-mps-control` first on PATH; returns the file its calls are recorded in (JSON lines)."""
    monkeypatch.setattr(gpu_split, "compute_mode", lambda: "Default")
    return fake_mps.install_on_path(tmp_path, monkeypatch)


def test_mps_starts_a_private_daemon_sets_each_share_and_stops_it_at_close(fake_control):
    said = []
    split = start_split(cfg_of("--rollout.sm_split", "mps", "--rollout.engine_sm_percent", "60"),
                        probe=Probe(compute_mode=lambda: "Default"), announce=said.append)
    directory = Path(split.directory)
    try:
        (start,) = calls(fake_control, 1)
        assert start["argv"] == ["-d"]
        assert start["CUDA_MPS_PIPE_DIRECTORY"] == str(directory / "pipe")  # the run's own, not /tmp/nvidia-mps
        assert start["CUDA_MPS_LOG_DIRECTORY"] == str(directory / "log")
        assert directory.name.startswith("ds_rlhf_mps_") and (directory / "pipe").is_dir()
        assert os.environ[PERCENT_VAR] == "40"  # this process (the trainer), before its CUDA starts
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == start["CUDA_MPS_PIPE_DIRECTORY"]
        assert split.engine_env() == {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"),
                                      "CUDA_MPS_LOG_DIRECTORY": str(directory / "log"), PERCENT_VAR: "60"}
        assert len(said) == 1 and "engines 60%" in said[0] and "trainer 40%" in said[0] and str(directory) in said[0]
    finally:
        split.close(wait_s=30)
    stop = calls(fake_control, 2)[1]
    assert stop["argv"] == [] and stop["stdin"].strip() == "quit"
    assert stop["CUDA_MPS_PIPE_DIRECTORY"] == str(directory / "pipe")
    assert not directory.exists()
    assert all(var not in os.environ for var in MPS_VARS)  # this process's environment as it was


def test_the_daemon_keeps_no_client_share_and_no_device_indices(monkeypatch, tmp_path):
    monkeypatch.setenv(PERCENT_VAR, "10")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    env = gpu_split.daemon_env(str(tmp_path))
    assert PERCENT_VAR not in env and "CUDA_VISIBLE_DEVICES" not in env  # index 3 of a renumbered list: another GPU
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8e1c0a2b")
    assert gpu_split.daemon_env(str(tmp_path))["CUDA_VISIBLE_DEVICES"] == "GPU-8e1c0a2b"


def test_the_daemon_is_stopped_when_the_run_is_killed(fake_control, tmp_path):
    """SIGKILL runs no handler: the guard sees its pipe close and stops the daemon all the same."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from ds_rlhf.config import parse_config
        from ds_rlhf.run.gpu_split import start_split
        cfg = parse_config({[*BENCH, "--rollout.sm_split", "mps"]!r}, recipe="train-ppo")
        split = start_split(cfg, announce=lambda line: None)
        print(split.directory, flush=True)
        time.sleep(600)
        """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    directory = Path(child.stdout.readline().split()[-1])
    assert calls(fake_control, 1)[0]["argv"] == ["-d"]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    stop = calls(fake_control, 2)[1]
    assert stop["stdin"].strip() == "quit" and stop["CUDA_MPS_PIPE_DIRECTORY"] == str(directory / "pipe")
    deadline = time.monotonic() + 30
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not directory.exists()


def test_a_daemon_that_fails_to_start_is_one_error_line(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-cuda-mps-control").write_text("#!/bin/sh\necho 'An instance is already running' >&2\nexit 1\n")
    (bin_dir / "nvidia-cuda-mps-control").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ConfigError, match=r"-d` exited with 1 \(An instance is already running\)") as info:
        start_split(cfg_of("--rollout.sm_split", "mps"), probe=Probe(compute_mode=lambda: "Default"))
    assert "\n" not in str(info.value) and PERCENT_VAR not in os.environ


# ---- each spawned process carries its share ------------------------------------------------------------------------
def test_each_spawned_engine_process_carries_the_engine_share(fake_control, tmp_path, monkeypatch):
    """The servers are spawned by `spawn_servers` / `ServerProcess` as in a run; each runs a module that writes its
    environment to a file (vLLM's server renames its process, which blanks /proc/PID/environ)."""
    dumps = tmp_path / "envs"
    dumps.mkdir()
    (tmp_path / "env_dump.py").write_text(
        "import json, os\n"
        f"open(os.path.join({str(dumps)!r}, str(os.getpid())), 'w').write(json.dumps(dict(os.environ)))\n")
    monkeypatch.setattr(ServerProcess, "module", "env_dump")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    split = start_split(cfg_of("--rollout.sm_split", "mps", "--rollout.engine_sm_percent", "65"),
                        probe=Probe(compute_mode=lambda: "Default"))
    servers: list = []
    try:
        servers = [*spawn_servers(2, extra_env=split.engine_env()), ServerProcess(extra_env=split.engine_env())]
        for server in servers:
            assert server.proc.wait(60) == 0
            env = json.loads((dumps / str(server.proc.pid)).read_text())
            assert env[PERCENT_VAR] == "65"  # the engines' share, not the trainer's 35
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(Path(split.directory) / "pipe")
            assert "DS_RLHF_ROLLOUT_ADDR" in env  # the server's own variables beside the split's
        assert os.environ[PERCENT_VAR] == "35"
    finally:
        for server in servers:
            server.close()
        split.close(wait_s=30)
