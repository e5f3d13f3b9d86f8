"""On-policy distillation (`rl.teacher`): the student samples, the teacher scores the student's own tokens, and the
per-token reverse KL to the teacher (k1 on the sampled tokens) is the reward; the student moves toward the teacher."""

from __future__ import annotations

import json

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.run.preflight import check_model_sources


def _mean(values):
    return sum(values) / len(values)


def test_the_student_moves_toward_the_teacher(tiny_model_path, sft_run, addition_stores, dist_single, tmp_path):
    teacher = sft_run[0] / "export"
    history = RLTrainer(parse_config([
        "--model.path", str(tiny_model_path), "--data.train", str(addition_stores["prompts"]),
        "--rl.teacher", str(teacher), "--rl.kl_coef", "1", "--rl.kl_in", "reward", "--rl.kl_estimator", "k1",
        "--rl.algo", "reinforce_pp", "--run.output_dir", str(tmp_path / "run"), "--run.steps", "24",
        "--rl.prompts_per_step", "8", "--rollout.n_samples", "4", "--rollout.max_new_tokens", "8",
        "--optim.lr", "3e-3", "--rollout.backend", "hf", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.export_hf", "false"])).train()
    kl = [h["kl/mean"] for h in history]  # the student's reverse KL to the teacher on its own samples
    print("reverse KL to the teacher by step", [round(k, 3) for k in kl])
    assert all(h["reward/mean"] == 0.0 for h in history)  # no reward function: the teacher alone teaches
    assert _mean(kl[-4:]) < 0.85 * _mean(kl[:4]), kl


def test_a_teacher_needs_the_kl_term():
    with pytest.raises(ConfigError, match="rl.teacher='t' distils through the KL term: set --rl.kl_coef > 0"):
        parse_config(["--rl.teacher", "t"])


def test_a_teacher_with_another_vocabulary_is_refused_before_loading(tiny_model_path, tmp_path):
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for path, vocab in ((student, 100), (teacher, 200)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
        (path / "model.safetensors").write_bytes(b"")
    cfg = parse_config(["--model.path", str(student), "--rl.teacher", str(teacher), "--rl.kl_coef", "1"])
    with pytest.raises(ConfigError, match="has a vocabulary of 200 tokens, the actor .* of 100"):
        check_model_sources(cfg)
