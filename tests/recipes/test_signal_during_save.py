"""A SIGTERM that arrives while a periodic checkpoint is being saved (SFT, RL) stops the run right after that save: no
further step is trained, and the run exits 128 + 15 with that checkpoint as its last."""

from __future__ import annotations

import os
import signal

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.sft import SFTTask
from ds_rlhf.recipes.supervised import SupervisedTrainer
from ds_rlhf.telemetry.logger import read_metrics


def test_sigterm_during_a_periodic_save_stops_after_that_save(tiny_model_path, dist_single, tmp_path):
    store = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=4, n_sft=64, n_pref=4, seed=0,
                                    max_operand=9)["sft"]
    run = tmp_path / "run"
    trainer = SupervisedTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(store), "--data.eval_fraction", "0",
        "--run.output_dir", str(run), "--run.steps", "6", "--run.save_every", "2", "--optim.batch_size", "4",
        "--optim.micro_batch_size", "4", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.export_hf", "false"]), SFTTask())
    _stops_right_after_the_first_periodic_save(trainer, run)


def test_sigterm_during_a_periodic_rl_save_stops_after_that_save(tiny_model_path, dist_single, tmp_path):
    store = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=16, n_sft=4, n_pref=4, seed=0,
                                    max_operand=9)["prompts"]
    run = tmp_path / "run"
    trainer = RLTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(store), "--reward.fn", "gsm8k",
        "--run.output_dir", str(run), "--run.steps", "5", "--run.save_every", "2", "--rl.prompts_per_step", "2",
        "--rollout.n_samples", "2", "--rollout.max_new_tokens", "4", "--rollout.backend", "hf",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"]))
    _stops_right_after_the_first_periodic_save(trainer, run)


def _stops_right_after_the_first_periodic_save(trainer, run):
    """SIGTERM lands while the first periodic save (step 2) writes: the run exits 128 + 15 right after that save,
    with no step trained and no checkpoint written after it."""
    save = trainer.ckpt.save
    saved_at = []

    def save_and_get_signalled(step, engines, state):
        if not saved_at:  # the first periodic save: the scheduler's SIGTERM lands while it writes
            os.kill(os.getpid(), signal.SIGTERM)
        saved_at.append(step)
        return save(step, engines, state)

    trainer.ckpt.save = save_and_get_signalled
    with pytest.raises(SystemExit) as info:
        trainer.train()
    assert info.value.code == 128 + signal.SIGTERM
    assert saved_at == [2]  # that save, and nothing after it
    assert trainer.step == 2 and [r["step"] for r in read_metrics(run)] == [1, 2]
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*"))] == ["step_00000002"]
