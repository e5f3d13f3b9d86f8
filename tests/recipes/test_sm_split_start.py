"""`RLTrainer` and `rollout.sm_split`: the split starts before the run does, the engines get its share through
`build_parts(server_env=...)`, and a start that fails stops the run's MPS daemon and restores the environment.

A fake `nvidia-cuda-mps-control` (`ds_rlhf.testing.fake_mps`) stands in for the real one, which needs an NVIDIA GPU
and driver; on this CPU machine the MPS variables reach no CUDA driver, so the run's CPU parts are unchanged."""

from __future__ import annotations

import os

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.recipes import rl_build
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.run import gpu_split
from ds_rlhf.testing import fake_mps
from ds_rlhf.testing.fake_mps import MPS_VARS, calls
from tests.recipes.stores import prompt_store


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """A fake `nvidia-cuda-mps-control` first on PATH; returns the file its calls are recorded in (JSON lines)."""
    monkeypatch.setattr(gpu_split, "compute_mode", lambda: "Default")
    return fake_mps.install_on_path(tmp_path, monkeypatch)


def sidecar_mps(tmp_path, train, *extra):
    return parse_config(["--data.train", str(train), "--reward.fn", "gsm8k", "--run.output_dir",
                         str(tmp_path / "run"), "--rollout.placement", "sidecar", "--rollout.sm_split", "mps",
                         "--rollout.engine_sm_percent", "55", *extra], recipe="train-ppo")


class Stop(Exception):
    pass


def test_the_engines_get_the_split_share_and_a_failed_start_stops_the_daemon(fake_control, tmp_path,
                                                                             tiny_model_path, monkeypatch):
    train = prompt_store(tmp_path, tiny_model_path)
    seen = {}

    def build_parts(ctx, rollout=None, server_env=None):
        seen.update(server_env=server_env, trainer=os.environ.get(gpu_split.PERCENT_VAR))
        raise Stop("stop after the split reached the build")

    monkeypatch.setattr(rl_build, "build_parts", build_parts)
    with pytest.raises(Stop):
        RLTrainer(sidecar_mps(tmp_path, train, "--model.path", str(tiny_model_path)))
    start, stop = calls(fake_control, 2)
    assert start["argv"] == ["-d"] and stop["stdin"].strip() == "quit"
    assert seen["server_env"][gpu_split.PERCENT_VAR] == "55" and seen["trainer"] == "45"
    assert seen["server_env"]["CUDA_MPS_PIPE_DIRECTORY"] == start["CUDA_MPS_PIPE_DIRECTORY"]
    assert all(var not in os.environ for var in MPS_VARS)


def test_a_preflight_refusal_stops_the_daemon(fake_control, tmp_path, tiny_model_path):
    with pytest.raises(Exception, match="does not exist|not found|no such"):
        RLTrainer(sidecar_mps(tmp_path, tmp_path / "absent", "--model.path", str(tiny_model_path)))
    start, stop = calls(fake_control, 2)
    assert start["argv"] == ["-d"] and stop["stdin"].strip() == "quit"
    assert all(var not in os.environ for var in MPS_VARS)
