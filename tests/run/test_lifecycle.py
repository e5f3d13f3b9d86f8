"""The run lifecycle (`run/lifecycle.py`) on real tiny runs, the same for the supervised loop (SFT) and the RL loop: a
SIGTERM during a step lets that step finish, saves it and exits 128 + 15, `status.json` says `stopped` at that step,
the run directory's lock is released and the process's own SIGTERM handler is back."""

from __future__ import annotations

import os
import signal

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.sft import SFTTask
from ds_rlhf.recipes.supervised import SupervisedTrainer
from ds_rlhf.run.monitor import read_status
from ds_rlhf.run.run_dir import acquire_run_lock
from ds_rlhf.telemetry.logger import read_metrics

COMMON = ["--run.steps", "4", "--run.save_every", "0", "--run.progress", "false", "--run.tensorboard", "false",
          "--run.export_hf", "false"]


@pytest.fixture(scope="module")
def stores(tiny_model_path, tmp_path_factory):
    return write_addition_datasets(tmp_path_factory.mktemp("lifecycle_data"), tiny_model_path, n_prompts=16,
                                   n_sft=64, n_pref=4, seed=0, max_operand=9)


def sft_trainer(model, stores, run):
    return SupervisedTrainer(parse_config([
        "--model.path", str(model), "--data.train", str(stores["sft"]), "--data.eval_fraction", "0",
        "--run.output_dir", str(run), "--optim.batch_size", "4", "--optim.micro_batch_size", "4", *COMMON]),
        SFTTask())


def rl_trainer(model, stores, run):
    return RLTrainer(parse_config([
        "--model.path", str(model), "--data.train", str(stores["prompts"]), "--reward.fn", "gsm8k",
        "--run.output_dir", str(run), "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
        "--rollout.max_new_tokens", "4", "--rollout.backend", "hf", *COMMON]))


@pytest.mark.parametrize("make", [sft_trainer, rl_trainer], ids=["sft", "rl"])
def test_sigterm_mid_step_saves_that_step_and_ends_stopped(make, tiny_model_path, stores, dist_single, tmp_path):
    run = tmp_path / "run"
    trainer = make(tiny_model_path, stores, run)
    handler = signal.getsignal(signal.SIGTERM)
    train_step = trainer.train_step

    def step_and_get_signalled():
        if trainer.step == 1:  # step 2 is running when the scheduler's SIGTERM lands
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step()

    trainer.train_step = step_and_get_signalled
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert trainer.step == 2 and [r["step"] for r in read_metrics(run)] == [1, 2]
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*"))] == ["step_00000002"]
    status = read_status(run)
    assert (status["status"], status["signal"], status["exit_code"], status["step"]) == (
        "stopped", "SIGTERM", 128 + signal.SIGTERM, 2)
    assert signal.getsignal(signal.SIGTERM) is handler
    acquire_run_lock(run).release()  # the run let go of its directory
