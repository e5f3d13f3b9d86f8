"""A reward model and reward functions together: each sample's reward is `reward.model_weight` x the RM's score
plus the functions' weighted sum, with each part logged."""

from __future__ import annotations

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.recipes.rl import RLTrainer

CONSTANT = "def two(prompt, response, ground_truth, metadata):\n    return 2.0\n"


def test_reward_is_the_weighted_sum_of_the_model_and_the_functions(tiny_model_path, tiny_reward_path, dist_single,
                                                                    tmp_path):
    store = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=8, n_sft=4, n_pref=4, seed=0,
                                    max_operand=9)["prompts"]
    (tmp_path / "r.py").write_text(CONSTANT)
    history = RLTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(store), "--rl.algo", "ppo",
        "--reward.model", str(tiny_reward_path), "--reward.model_weight", "0.5",
        "--reward.fn", f"{tmp_path / 'r.py'}:two", "--reward.workers", "0",
        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "1", "--rl.prompts_per_step", "2",
        "--rollout.n_samples", "2", "--rollout.max_new_tokens", "4", "--rollout.backend", "hf",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"])).train()
    step = history[-1]
    assert step["reward/model"] != 0.0  # the tiny RM's score head gives each sample its own score
    assert step["reward/mean"] == pytest.approx(2.0 + 0.5 * step["reward/model"], abs=1e-5)


def test_a_reward_model_weight_without_both_rewards_is_refused():
    with pytest.raises(ConfigError, match="reward.model_weight=0.5 weighs the reward model against reward"):
        parse_config(["--reward.model", "/some/rm", "--reward.model_weight", "0.5"])
