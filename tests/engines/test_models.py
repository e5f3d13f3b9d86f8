"""Model roles: reward scoring at the last non-pad token, critic init/export, LoRA, gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.engines.models import GC_KWARGS, CriticModel, RewardModel, load_causal_lm, merge_lora_state_dict

TOL = 1e-5  # fp32, same weights: only summation-order noise


def _padded(ids: torch.Tensor, pad: int, n_pad: int = 3):
    right = torch.cat([ids, torch.full((ids.shape[0], n_pad), pad)], 1)
    mask_r = torch.cat([torch.ones_like(ids), torch.zeros(ids.shape[0], n_pad, dtype=torch.long)], 1)
    left = torch.cat([torch.full((ids.shape[0], n_pad), pad), ids], 1)
    return right, mask_r, left, mask_r.flip(-1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(5, 300, (2, 9), generator=torch.Generator().manual_seed(0))


def test_reward_scores_last_real_token_for_left_and_right_padding(tiny_reward_path, ids):
    from transformers import AutoModelForSequenceClassification

    rm = RewardModel.from_pretrained(tiny_reward_path, attn_impl="sdpa")
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_reward_path)
    right, mask_r, left, mask_l = _padded(ids, pad=rm.config.pad_token_id)
    with torch.no_grad():
        plain = rm(ids)
        torch.testing.assert_close(plain, reference(ids).logits.squeeze(-1), atol=TOL, rtol=0)
        torch.testing.assert_close(rm(right, mask_r), plain, atol=TOL, rtol=0)
        torch.testing.assert_close(rm(left, mask_l), plain, atol=TOL, rtol=0)
    assert plain.shape == (2,) and plain.dtype == torch.float32


def test_critic_from_reward_copies_the_score_head(tiny_reward_path, ids, tmp_path):
    critic = CriticModel.from_pretrained(tiny_reward_path, "reward", attn_impl="sdpa")
    rm = RewardModel.from_pretrained(tiny_reward_path, attn_impl="sdpa")
    right, mask_r, left, mask_l = _padded(ids, pad=rm.config.pad_token_id)
    with torch.no_grad():
        values = critic(ids)
        assert values.shape == ids.shape
        torch.testing.assert_close(values[:, -1], rm(ids), atol=TOL, rtol=0)
        torch.testing.assert_close(critic(left, mask_l)[:, 3:], values, atol=TOL, rtol=0)
        torch.testing.assert_close(critic(right, mask_r)[:, :9], values, atol=TOL, rtol=0)
    out = critic.save_pretrained(tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(RewardModel.from_pretrained(out)(ids), values[:, -1], atol=TOL, rtol=0)
        torch.testing.assert_close(CriticModel.from_pretrained(out, "reward")(ids), values, atol=TOL, rtol=0)


def test_critic_from_actor_shares_the_backbone(tiny_model_path, ids):
    actor = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa")
    critic = CriticModel.from_pretrained(tiny_model_path, "actor", attn_impl="sdpa")
    for name, p in critic.backbone.named_parameters():
        assert torch.equal(p, actor.model.get_parameter(name)), name
    with torch.no_grad():
        values = critic(ids)
    assert values.shape == ids.shape and values.abs().max() < 1.0  # small head init: values start near 0


def test_lora_trains_only_adapters_and_merges_exactly(tiny_model_path, tiny_reward_path, ids):
    actor = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa", lora={"r": 4})
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for name, p in actor.named_parameters():  # make the adapters non-trivial (B starts at 0)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    merged = merge_lora_state_dict(dict(actor.state_dict()), actor)
    plain = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa")
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, actor(ids).logits, atol=1e-4, rtol=0)
    critic = CriticModel.from_pretrained(tiny_reward_path, "reward", attn_impl="sdpa", lora={"r": 4})
    names = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert "value_head.weight" in names and all("lora_" in n for n in names if n != "value_head.weight")


def test_gradient_checkpointing_is_non_reentrant_and_exact(tiny_model_path, ids):
    grads = {}
    for gc in (False, True):
        model = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa", gradient_checkpointing=gc)
        model.train()
        assert model.is_gradient_checkpointing == gc
        model(input_ids=ids, labels=ids).loss.backward()
        grads[gc] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert GC_KWARGS == {"use_reentrant": False}
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-6, rtol=0)


def test_lora_settings_from_the_config_build_a_lora_actor(tiny_model_path):
    """Regression: the config's LoRA keys reached peft as 'alpha'/'targets' (TypeError for any lora_rank > 0)."""
    from ds_rlhf.config import parse_config
    from ds_rlhf.engines.models import lora_settings

    cfg = parse_config(["--model.lora_rank", "4", "--model.lora_alpha", "8"])
    actor = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa", lora=lora_settings(cfg.model))
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert lora_settings(parse_config([]).model) is None


def test_reward_model_gradient_checkpointing_is_exact(tiny_reward_path, ids):
    """Regression: the RM trainer looked for `gradient_checkpointing_enable` on `RewardModel`, which had none, so
    `model.gradient_checkpointing` was silently ignored for RM runs (an 8B RM step then ran out of memory)."""
    from ds_rlhf.engines.models import RewardModel

    grads = {}
    for gc in (False, True):
        model = RewardModel.from_pretrained(tiny_reward_path, dtype="fp32", attn_impl="sdpa").train()
        if gc:
            model.gradient_checkpointing_enable()
        assert model.model.is_gradient_checkpointing == gc
        model(ids).sum().backward()
        grads[gc] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[False]
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-6, rtol=0)


def test_lora_base_loads_in_the_compute_dtype_with_the_same_values(tiny_model_path):
    """builder.load_dtypes: a LoRA model's frozen base loads in the compute dtype (half the host memory), and
    after DeepSpeed's cast of every parameter to it the module holds exactly what the fp32 load gives (peft keeps
    the adapters in fp32 either way)."""
    from ds_rlhf.engines.builder import load_dtypes
    from tests.engines.workers import resolved

    bf16 = resolved("zero2", world_size=1, precision="bf16")
    lora = {"r": 4, "lora_alpha": 8}
    assert load_dtypes(bf16, True) == {"dtype": "fp32", "compute_dtype": "bf16"}
    assert load_dtypes(bf16, True, lora=lora) == {"dtype": "bf16", "compute_dtype": "bf16"}
    assert load_dtypes(bf16, True, lora=lora, quantize="nf4")["dtype"] == "fp32"
    assert load_dtypes(bf16, False) == {"dtype": "bf16", "compute_dtype": "bf16"}
    models = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)  # peft's adapter init
        models[dtype] = load_causal_lm(tiny_model_path, dtype=dtype, compute_dtype="bf16", attn_impl="sdpa",
                                       lora=lora)
    base = [p for n, p in models["bf16"].named_parameters() if "lora_" not in n]
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    cast = {n: p.detach().to(torch.bfloat16) for n, p in models["fp32"].named_parameters()}
    direct = {n: p.detach().to(torch.bfloat16) for n, p in models["bf16"].named_parameters()}
    assert cast.keys() == direct.keys() and any("lora_A" in n for n in direct)
    for name, value in cast.items():
        assert torch.equal(direct[name], value), name
