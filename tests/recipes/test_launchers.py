"""train_ppo.py under the launchers DeepSpeed users use: `deepspeed` and `accelerate launch`, two ranks on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.multiproc import clean_env, free_port
from tests.recipes.test_rl_e2e import ROOT

pytestmark = pytest.mark.extended


BIN = Path(sys.executable).parent


def _args(out, model, stores):
    return ["launch/train_ppo.py", "--model.path", str(model), "--data.train", str(stores["prompts"]),
            "--run.output_dir", str(out), "--run.steps", "2", "--reward.fn", "math_shaped",
            "--rl.prompts_per_step", "8", "--rollout.n_samples", "4", "--rollout.max_new_tokens", "16",
            "--run.progress", "false", "--run.tensorboard", "false"]


def _run(cmd, out):
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.multiproc
def test_deepspeed_launcher_two_ranks_zero3(sft_run, addition_stores, tmp_path):
    out = tmp_path / "run"
    log = _run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                *_args(out, sft_run[0] / "export", addition_stores), "--ds_config", "ds_configs/zero3.json"], out)
    assert "world size 2" in log
    assert json.loads((out / "ds_config.actor.json").read_text())["zero_optimization"]["stage"] == 3
    assert (out / "export" / "actor" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_launch_with_deepspeed_plugin(sft_run, addition_stores, tmp_path):
    out = tmp_path / "run"
    log = _run([str(BIN / "accelerate"), "launch", "--use_deepspeed", "--zero_stage", "3", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port()), *_args(out, sft_run[0] / "export", addition_stores)], out)
    assert "world size 2" in log
    # the plugin's ZeRO stage reached DeepSpeed even though the default ds_config file says stage 2
    assert json.loads((out / "ds_config.actor.json").read_text())["zero_optimization"]["stage"] == 3


def _dpo_losses(cmd: list[str], out: Path) -> list[float]:
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x)["dpo/loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if "dpo/loss" in x]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("ds_config", ["zero2", "zero3"])
def test_dpo_on_two_ranks_matches_one_rank(sft_run, addition_stores, tmp_path, ds_config):
    """`deepspeed --num_gpus 2 launch/train_dpo.py`: 2 ranks x 4 pairs (`optim.batch_size` is per rank; micro-batch
    2, gradient accumulation 2) train on the same 8 pairs per step as one rank with a batch of 8, with the same step
    losses (the logged loss is the mean over ranks)."""
    def argv(out, batch):
        return ["launch/train_dpo.py", "--model.path", str(sft_run[0] / "export"), "--data.train",
                str(addition_stores["preference"]), "--run.output_dir", str(out), "--run.steps", "3",
                "--optim.batch_size", batch, "--optim.micro_batch_size", "2", "--optim.lr", "1e-3",
                "--data.eval_fraction", "0.05", "--run.progress", "false", "--run.tensorboard", "false",
                "--ds_config", f"ds_configs/{ds_config}.json"]
    one = _dpo_losses([sys.executable, *argv(tmp_path / "one", "8")], tmp_path / "one")
    two = _dpo_losses([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                       *argv(tmp_path / "two", "4")], tmp_path / "two")
    assert len(one) == 3 and one[0] == pytest.approx(0.6931, abs=1e-3)  # step 1: policy == reference, log 2
    assert two == pytest.approx(one, abs=2e-4)
    assert (tmp_path / "two" / "export" / "config.json").exists()
