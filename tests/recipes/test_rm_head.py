"""A model's head must fit its role. A reward model must hold its trained score head: a causal LM (an SFT export)
given as `reward.model` would get a randomly initialised head and score noise. Refused in one line by preflight
(the weight files' headers only) and by the load itself; an RM run's starting model (`new_head=True`) still starts
from a causal LM. A reward model export as the RL or DPO policy, the SFT model or `rl.teacher` would generate with a
random LM head: refused in one line by preflight, before any model loads."""

from __future__ import annotations

import json
import shutil

import pytest

from ds_rlhf.cli import run_entry
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines import models
from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.rm_head import check_reward_model_dir, sequence_classifier
from ds_rlhf.entrypoints.train import DPO_DEFAULTS, PPO_DEFAULTS, run_dpo, run_ppo
from ds_rlhf.run.preflight import check_model_sources


def test_reward_model_without_a_trained_score_head_is_refused(tiny_model_path, tiny_reward_path, monkeypatch):
    check_reward_model_dir(tiny_reward_path)
    with pytest.raises(ConfigError, match=r"score\.weight") as refused:
        check_reward_model_dir(tiny_model_path)
    assert str(tiny_model_path) in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"score\.weight"):
        RewardModel.from_pretrained(tiny_model_path, attn_impl="eager")
    assert RewardModel.from_pretrained(tiny_model_path, attn_impl="eager", new_head=True) is not None
    # the load itself refuses too (weights the header check cannot read, e.g. pytorch_model.bin)
    monkeypatch.setattr(models, "check_reward_model_dir", lambda path: None)
    with pytest.raises(ConfigError, match=r"no trained score head"):
        RewardModel.from_pretrained(tiny_model_path, attn_impl="eager")


def test_preflight_refuses_a_causal_lm_as_the_reward_model(tiny_model_path, tiny_reward_path):
    cfg = parse_config(["--model.path", str(tiny_model_path), "--reward.model", str(tiny_model_path)])
    with pytest.raises(ConfigError, match="score") as info:
        check_model_sources(cfg, "rl")
    assert str(tiny_model_path) in str(info.value) and "\n" not in str(info.value)
    check_model_sources(parse_config(["--model.path", str(tiny_model_path), "--reward.model",
                                      str(tiny_reward_path)]), "rl")


@pytest.mark.parametrize("kind,role", [("rl", "RL policy"), ("dpo", "DPO policy"), ("sft", "SFT model")])
def test_preflight_refuses_a_reward_model_as_the_policy(tiny_model_path, tiny_reward_path, kind, role):
    with pytest.raises(ConfigError, match=rf"^model.path='{tiny_reward_path}' is a reward model \(a sequence-"
                                          rf"classification head: config.json's architectures name \w+ForSequence"
                                          rf"Classification\), not a causal LM, so it cannot be the {role}"):
        check_model_sources(parse_config(["--model.path", str(tiny_reward_path)]), kind)
    check_model_sources(parse_config(["--model.path", str(tiny_model_path)]), kind)
    check_model_sources(parse_config(["--model.path", str(tiny_reward_path)]), "rm")  # an RM run may go on from one


def test_preflight_refuses_a_reward_model_as_the_teacher(tiny_model_path, tiny_reward_path):
    argv = ["--model.path", str(tiny_model_path), "--rl.kl_coef", "1", "--reward.fn", "gsm8k"]
    with pytest.raises(ConfigError, match=rf"^rl.teacher='{tiny_reward_path}' is a reward model .* cannot be the "
                                          r"teacher \(the reference of the KL term\)"):
        check_model_sources(parse_config([*argv, "--rl.teacher", str(tiny_reward_path)]), "rl")
    check_model_sources(parse_config([*argv, "--rl.teacher", str(tiny_model_path)]), "rl")


def test_every_mark_of_a_reward_model_export_is_read(tiny_model_path, tmp_path):
    assert sequence_classifier(tiny_model_path) is None
    marked = tmp_path / "marked"
    shutil.copytree(tiny_model_path, marked)
    (marked / "ds_rlhf_reward.json").write_text("{}")
    assert "ds_rlhf_reward.json" in sequence_classifier(marked)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS", "peft_type": "LORA"}))
    assert "task_type SEQ_CLS" in sequence_classifier(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "peft_type": "LORA"}))
    assert sequence_classifier(adapter) is None


@pytest.mark.parametrize("run,defaults,extra,key", [
    (run_dpo, DPO_DEFAULTS, ["--model.path", "{rm}"], "model.path"),
    (run_ppo, PPO_DEFAULTS, ["--rl.teacher", "{rm}", "--rl.kl_coef", "1"], "rl.teacher")])
def test_the_command_line_refuses_a_reward_model_in_a_policy_role_in_one_line(tiny_reward_path, tmp_path, monkeypatch,
                                                                             run, defaults, extra, key):
    monkeypatch.delenv("DS_RLHF_DEBUG", raising=False)
    argv = ["--data.train", str(tmp_path / "store"), "--run.output_dir", str(tmp_path / "run"),
            *[a.format(rm=tiny_reward_path) for a in extra]]
    with pytest.raises(SystemExit) as info:
        run_entry("doc", defaults, run, argv)
    assert str(info.value.code).startswith(f"error: {key}='{tiny_reward_path}' is a reward model")
    assert "\n" not in str(info.value.code) and not (tmp_path / "run").exists()  # before any run directory
