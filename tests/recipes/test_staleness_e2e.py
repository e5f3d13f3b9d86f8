"""A short async RL run on the tiny model (HF backend) with `rollout.max_staleness 2`: the per-step staleness
metrics and each logged sample's weights version follow the bound, and a run stopped after a checkpoint taken while
the engine still held older weights resumes onto exactly the uninterrupted run's steps; a run evaluating after every
step trains exactly as one without evaluation."""

from __future__ import annotations

import json

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.telemetry.logger import read_metrics
from tests.recipes.stores import prompt_store

REWARD_FILE = '''
def parity(prompt, response, ground_truth, metadata):
    return float(sum(map(ord, response)) % 2)
'''
EXACT = ("reward/mean", "actor/loss", "actor/entropy", "response/len_mean", "mismatch/kl_rollout_trainer",
         "rollout/staleness", "rollout/staleness_mean", "rollout/staleness_max")


class _Stop(Exception):
    pass


def _cfg(tmp_path, tiny_model_path, out, *extra):
    reward = tmp_path / "parity.py"
    reward.write_text(REWARD_FILE)
    store = tmp_path / "prompts"
    if not store.exists():
        prompt_store(tmp_path, tiny_model_path, lengths=tuple(range(2, 14)))
    return parse_config(["--model.path", str(tiny_model_path), "--data.train", str(store), "--reward.fn",
                         f"{reward}:parity", "--rl.prompts_per_step", "4", "--rollout.n_samples", "4",
                         "--rollout.max_new_tokens", "6", "--rollout.backend", "hf", "--run.steps", "6",
                         "--rollout.async_generation", "true", "--rollout.max_staleness", "2",
                         "--optim.lr", "5e-3", "--rl.mismatch", "tis", "--run.save_every", "3",
                         "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false",
                         "--run.sample_log_every", "1", "--run.sample_log_k", "16", "--run.output_dir", str(out),
                         *extra])


def test_staleness_metrics_exact_resume_and_evaluation_at_k_2(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    straight = RLTrainer(_cfg(tmp_path, tiny_model_path, tmp_path / "a")).train()
    # one sync every 2 steps: batches 0, 1, 2, 1, 2, 1 updates old
    assert [h["rollout/staleness_max"] for h in straight] == [0, 1, 2, 1, 2, 1]
    assert [h["rollout/staleness_mean"] for h in straight] == [h["rollout/staleness"] for h in straight]
    for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)  # each sample's own weights version, within the bound
        assert 0 <= row["step"] - 1 - row["weights_version"] <= 2

    first = RLTrainer(_cfg(tmp_path, tiny_model_path, tmp_path / "b"))
    step_once = first.train_step

    def stop_after_step_3():
        if first.step == 3:
            raise _Stop  # as a crash would, after step 3's checkpoint (the engine holds the weights after 2)
        return step_once()

    first.train_step = stop_after_step_3
    with pytest.raises(_Stop):
        first.train()
    resumed = RLTrainer(_cfg(tmp_path, tiny_model_path, tmp_path / "b", "--run.resume", "latest"))
    assert resumed.step == 3 and resumed.service.schedule_version == 2
    resumed.train()
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        for key in EXACT:
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-7), (ra["step"], key)

    # an evaluation after every step syncs the engine to that step's weights, yet the run trains as without it
    evaluated = RLTrainer(_cfg(tmp_path, tiny_model_path, tmp_path / "c", "--data.eval", str(tmp_path / "prompts"),
                               "--run.eval_every", "1", "--eval.max_prompts", "4")).train()
    assert all("eval/pass@1" in h for h in evaluated)
    for ha, hc in zip(straight, evaluated):
        for key in EXACT:
            assert ha[key] == pytest.approx(hc[key], rel=1e-6, abs=1e-7), key
