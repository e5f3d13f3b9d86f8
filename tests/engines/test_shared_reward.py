"""model.share_base with a reward model: a LoRA RM adapter of the actor's base runs on that base
(engines/shared_reward.py); any other RM stays a separate frozen model, with the reason printed."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.engines.builder import build_actor
from ds_rlhf.engines.models import RewardModel, unwrap
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.engines.shared_critic import actor_decoder, owned_parameters
from ds_rlhf.engines.shared_reward import build_shared_reward, shared_reward_refusal
from tests.engines.workers import lm_batch, resolved, train_lm

LORA = {"r": 8, "lora_alpha": 32}


@pytest.fixture(scope="module")
def rm_adapter(tiny_model_path, tmp_path_factory):
    """A LoRA-trained RM of the tiny model as peft writes it: SEQ_CLS adapters (B != 0) and a trained score head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    seqcls = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    peft = get_peft_model(seqcls, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("rm_adapter")
    peft.save_pretrained(out)
    return out


def _separate_rm(model_path, adapter) -> RewardModel:
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    seqcls = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, attn_implementation="sdpa")
    return RewardModel(PeftModel.from_pretrained(seqcls, str(adapter)).merge_and_unload()).eval()


@pytest.mark.parametrize("stage", [0, 2])
def test_lora_rm_scores_on_the_actor_base(tiny_model_path, rm_adapter, dist_single, stage):
    actor = build_actor(tiny_model_path, resolved("zero2", stage=stage), attn_impl="sdpa", lora=LORA)
    train_lm(actor, 0, 2)  # the actor's adapters are not zero: the RM must not see them
    assert shared_reward_refusal(rm_adapter, tiny_model_path, stage) is None
    reward = build_shared_reward(actor, rm_adapter, resolved("zero2", stage=stage))
    batch = torch.cat([lm_batch(0), lm_batch(1)])
    mask = torch.ones_like(batch)
    mask[1, 10:] = 0  # a shorter row: scored at its last real token
    actor.train()
    with torch.no_grad():
        actor_before, _ = sequence_logprobs(actor, batch, mask)
        scores = reward(input_ids=batch, attention_mask=mask)
        expected = _separate_rm(tiny_model_path, rm_adapter)(input_ids=batch, attention_mask=mask)
        actor_after, _ = sequence_logprobs(actor, batch, mask)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(actor_after, actor_before, atol=0, rtol=0)
    own = owned_parameters(reward.module, actor_decoder(actor))
    assert own and all("lora_" in n or ".score." in n for n, _ in own), [n for n, _ in own]
    base_ptrs = {p.data_ptr() for n, p in unwrap(actor).named_parameters() if "lora_" not in n}
    own_ids = {id(p) for _, p in own}
    assert all(p.data_ptr() in base_ptrs for p in reward.module.parameters() if id(p) not in own_ids)
    assert train_lm(actor, 0, 1) and unwrap(actor).training  # the actor trains on after the RM's passes


def test_other_rms_stay_separate(tiny_model_path, tiny_reward_path, rm_adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    assert "full model" in shared_reward_refusal(tiny_reward_path, tiny_model_path, 0)  # what our RM stage writes
    assert "ZeRO-3" in shared_reward_refusal(rm_adapter, tiny_model_path, 3)
    other = tmp_path / "other_base"
    shutil.copytree(rm_adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/other-7b"}))
    assert "not of the actor's base" in shared_reward_refusal(other, tiny_model_path, 0)
    no_head = tmp_path / "no_head"
    shutil.copytree(rm_adapter, no_head)
    weights = load_file(str(no_head / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if "score" not in k}, str(no_head / "adapter_model.safetensors"))
    assert "no trained score head" in shared_reward_refusal(no_head, tiny_model_path, 0)


def test_reward_stage_says_which_rm_it_built(tiny_model_path, tiny_reward_path, rm_adapter, dist_single, tmp_path):
    from ds_rlhf.config import parse_config
    from ds_rlhf.recipes.rl_build import _reward_stage

    actor = build_actor(tiny_model_path, resolved("zero2", stage=0), attn_impl="sdpa", lora=LORA)
    said = {}
    for name, rm in (("adapter", rm_adapter), ("full", tiny_reward_path)):
        lines: list[str] = []
        cfg = parse_config(["--model.path", str(tiny_model_path), "--model.lora_rank", "8", "--model.share_base",
                            "true", "--reward.model", str(rm)])
        ctx = SimpleNamespace(cfg=cfg, model_path=str(tiny_model_path), print=lines.append,
                              ds_config=lambda **_: resolved("zero2", stage=0))
        module = _reward_stage(ctx, None, "sdpa", actor).model.module
        shares = len(owned_parameters(module, actor_decoder(actor))) < len(list(module.parameters()))
        said[name] = (lines, shares)
    assert said["adapter"][1] and said["adapter"][0] == [
        f"[rl] model.share_base: the reward model is {rm_adapter}'s LoRA adapters + score head on the actor's base, "
        "no copy of its own"]
    full_lines = said["full"][0]
    assert not said["full"][1] and len(full_lines) == 1 and "separate frozen model" in full_lines[0]
    assert "full model" in full_lines[0]
