"""--run.profile_memory: per-phase peaks measured in a real (tiny, CPU) RL run next to the plan's phases."""

from __future__ import annotations

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.memory.profile import MemoryProfiler
from ds_rlhf.telemetry import PhaseTimer


def test_phases_are_measured_and_an_unplanned_share_is_flagged_once(tiny_model_path):
    import torch

    said = []
    prof = MemoryProfiler(parse_config(["--model.path", str(tiny_model_path), "--reward.fn", "gsm8k",
                                        "--rollout.backend", "hf"]),
                          torch.device("cpu"), 1, announce=said.append)
    timer = PhaseTimer()
    timer.observer = prof
    extra = prof.plan.phases["train"] + (512 << 20)  # more than the whole plan: at least 512 MiB unexplained
    with timer.phase("train"):
        big = bytearray(extra)
        big[::4096] = b"x" * len(big[::4096])  # touch every page: resident
    metrics = prof.step_metrics()
    del big
    # RSS is the CPU measure: the rest of the process may shrink by a few MiB meanwhile (freed objects, malloc trims)
    assert metrics["memory/train_peak_gib"] >= (extra - (64 << 20)) / (1 << 30)
    assert metrics["memory/plan_train_gib"] > 0 and metrics["memory/plan_rollout_gib"] > 0
    assert metrics["memory/other_frac"] > 0.05
    assert len(said) == 1 and "phase train" in said[0]
    with timer.phase("train"):
        pass
    prof.step_metrics()
    assert len(said) == 1  # said once


@pytest.mark.slow
def test_profile_memory_in_an_rl_run(tiny_model_path, tmp_path):
    from ds_rlhf.data.synthetic import write_addition_datasets
    from ds_rlhf.recipes.rl import RLTrainer

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=32, n_sft=8, n_pref=8, seed=0,
                                     max_operand=9)
    cfg = parse_config(["--model.path", str(tiny_model_path), "--data.train", str(stores["prompts"]),
                        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "2", "--reward.fn",
                        "math_shaped", "--rl.prompts_per_step", "2", "--rollout.n_samples", "2",
                        "--rollout.max_new_tokens", "8", "--rollout.backend", "hf", "--run.profile_memory", "true",
                        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"])
    history = RLTrainer(cfg).train()
    for h in history:
        assert h["memory/train_peak_gib"] > 0 and h["memory/rollout_peak_gib"] > 0
        assert "memory/plan_train_gib" in h and "memory/other_frac" in h
