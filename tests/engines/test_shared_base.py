"""model.share_base: the reference is the LoRA actor with its adapters disabled (engines/shared_base.py)."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.engines.builder import build_actor, build_reference, build_shared_reference
from ds_rlhf.engines.models import unwrap
from ds_rlhf.engines.policy_forward import sequence_logprobs
from tests.engines.workers import lm_batch, resolved, train_lm

LORA = {"r": 8, "lora_alpha": 32}


def _lora_b_norm(engine) -> float:
    """Sum of |B| over the adapters (ZeRO-3: the full tensors, gathered)."""
    import deepspeed

    params = [p for n, p in unwrap(engine).named_parameters() if "lora_B" in n]
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return float(sum(p.detach().abs().sum() for p in params))


@pytest.mark.parametrize("stage", [0, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3: one more engine
def test_adapter_off_reference_is_the_base_model(tiny_model_path, dist_single, stage):
    from transformers import AutoModelForCausalLM

    actor = build_actor(tiny_model_path, resolved("zero3" if stage == 3 else "zero2", stage=stage),
                        attn_impl="sdpa", gradient_checkpointing=True, lora=LORA)
    reference = build_shared_reference(actor)
    batch, mask = lm_batch(0), torch.ones(2, 16, dtype=torch.long)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        base_logp, _ = sequence_logprobs(plain, batch, mask)
        before, _ = sequence_logprobs(reference, batch, mask)
    torch.testing.assert_close(before, base_logp, atol=1e-6, rtol=0)

    losses = train_lm(actor, 0, 3)  # the adapters learn: B != 0, the actor moves away from the base
    trained = _lora_b_norm(actor)
    assert trained > 0 and losses[-1] < losses[0]
    actor.train()
    with torch.no_grad():
        ref_logp, _ = sequence_logprobs(reference, batch, mask)
        actor_logp, _ = sequence_logprobs(actor, batch, mask)
    torch.testing.assert_close(ref_logp, base_logp, atol=1e-6, rtol=0)
    assert (actor_logp - base_logp).abs().max() > 1e-3
    # the pass left the actor as it was: training mode, adapters on and trainable, and its optimizer still steps
    peft = unwrap(actor)
    assert peft.training and not peft._adapters_disabled
    assert all(p.requires_grad for n, p in peft.named_parameters() if "lora_" in n)
    train_lm(actor, 0, 1)
    assert _lora_b_norm(actor) != trained
    # a full forward (logits) through the reference is the base model's too
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids=batch).logits, plain(input_ids=batch).logits,
                                   atol=1e-5, rtol=0)


def test_shared_reference_holds_no_weights(tiny_model_path, dist_single):
    actor = build_actor(tiny_model_path, resolved("zero2", stage=0), attn_impl="sdpa", lora=LORA)
    separate = build_reference(tiny_model_path, resolved("zero2", stage=0), attn_impl="sdpa")
    shared = build_shared_reference(actor)
    base = sum(p.numel() for n, p in unwrap(actor).named_parameters() if "lora_" not in n)
    assert sum(p.numel() for p in separate.module.parameters()) == base  # a second copy of the base
    assert sum(p.numel() for p in shared.parameters()) == 0 and shared.actor is actor


def test_shared_reference_needs_lora(tiny_model_path, dist_single):
    actor = build_actor(tiny_model_path, resolved("zero2", stage=0), attn_impl="sdpa")
    with pytest.raises(ValueError, match="model.lora_rank"):
        build_shared_reference(actor)
