"""Each policy loss of `--rl.policy_loss` in a real two-step GRPO run on the tiny model (HF generation, CPU): two PPO
epochs, so the second epoch's ratios move off 1 and every loss's clipping / gating path runs inside the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.engines.models import unwrap
from ds_rlhf.recipes.rl import RLTrainer

LOSSES = {"gspo": ["--rl.clip_low", "3e-4", "--rl.clip_high", "4e-4", "--rl.loss_agg", "seq-mean-token-mean"],
          "gspo-token": ["--rl.clip_low", "3e-4", "--rl.clip_high", "4e-4"],
          "cispo": ["--rl.clip_high", "4"],
          "sapo": ["--rl.sapo_tau_pos", "1.0", "--rl.sapo_tau_neg", "1.05", "--rl.loss_agg", "seq-mean-token-mean"],
          "gmpo": ["--rl.clip_low", "0.4", "--rl.clip_high", "0.4", "--rl.loss_agg", "seq-mean-token-mean"]}


def varied_reward(prompt, response, ground_truth, metadata):
    """A reward that differs between the samples of a prompt even for the untrained tiny model: distinct
    characters in the response."""
    return len(set(response)) / 10.0


@pytest.fixture(scope="module")
def loss_stores(tiny_model_path, tmp_path_factory):
    from ds_rlhf.data.synthetic import write_addition_datasets

    return write_addition_datasets(tmp_path_factory.mktemp("policy_loss_data"), tiny_model_path, n_prompts=16,
                                   n_sft=8, n_pref=8, max_operand=20)


@pytest.mark.parametrize("name", list(LOSSES))
def test_two_grpo_steps_with_each_policy_loss(name, loss_stores, dist_single, tmp_path):
    args = ["--model.path", "tiny", "--data.train", str(loss_stores["prompts"]), "--run.output_dir", str(tmp_path),
            "--run.steps", "2", "--rl.algo", "grpo", "--reward.fn", f"{__file__}:varied_reward",
            "--reward.workers", "0", "--rl.policy_loss", name, "--rl.ppo_epochs", "2",
            "--rl.prompts_per_step", "4", "--rollout.n_samples", "4", "--rollout.max_new_tokens", "8",
            "--rollout.backend", "hf", "--rollout.temperature", "1.5", "--optim.lr", "1e-2",
            "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"]
    cfg = parse_config([*args, *LOSSES[name]])
    trainer = RLTrainer(cfg)
    actor = unwrap(trainer.parts.actor)
    before = [p.detach().clone() for p in actor.parameters()]
    history = trainer.train()
    assert len(history) == 2 and all(h["reward/std"] > 0 for h in history)
    # the trainer ran the chosen loss, not PPO's (whose metrics include dual_clip_frac)
    assert "actor/dual_clip_frac" not in history[-1]
    assert ("actor/seq_ratio_mean" in history[-1]) == name.startswith("gspo")
    for h in history:
        for key in ("actor/loss", "actor/clip_frac", "actor/approx_kl", "actor/ratio_max"):
            assert math.isfinite(h[key]), (key, h)
    # the second epoch trains on moved weights: its ratios differ from 1, and the update changed the actor
    assert max(h["actor/ratio_max"] for h in history) > 1.0
    assert any(not torch.equal(b, p) for b, p in zip(before, actor.parameters()))
