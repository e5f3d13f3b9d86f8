"""A reward model must hold its trained score head: a causal LM (an SFT export) given as `rl.reward_model` would
get a randomly initialised head and score noise. Refused in one line by preflight (the weight files' headers only)
and by the load itself; an RM run's starting model (`new_head=True`) still starts from a causal LM."""

from __future__ import annotations

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines import models
from ds_rlhf.engines.models import RewardModel
from ds_rlhf.engines.rm_head import check_reward_model_dir
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
    cfg = parse_config(["--model.path", str(tiny_model_path), "--rl.reward_model", str(tiny_model_path)])
    with pytest.raises(ConfigError, match="score") as info:
        check_model_sources(cfg, "rl")
    assert str(tiny_model_path) in str(info.value) and "\n" not in str(info.value)
    check_model_sources(parse_config(["--model.path", str(tiny_model_path), "--rl.reward_model",
                                      str(tiny_reward_path)]), "rl")
