"""model.share_base with a critic: LoRA adapters + a value head on the actor's base (engines/shared_critic.py)."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.config import ConfigError
from ds_rlhf.engines.builder import build_actor, build_critic, build_shared_reference
from ds_rlhf.engines.models import unwrap
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.engines.shared_critic import actor_decoder, build_shared_critic, owned_parameters
from tests.engines.workers import lm_batch, resolved, train_critic, train_lm

LORA = {"r": 8, "lora_alpha": 32}
MASK = torch.ones(2, 16, dtype=torch.long)


def _pair(model_path, stage: int, head_from=None):
    actor = build_actor(model_path, resolved("zero2", stage=stage), attn_impl="sdpa", gradient_checkpointing=True,
                        lora=LORA)
    critic = build_shared_critic(actor, resolved("zero2", stage=stage, lr=1e-3), lora=LORA, head_from=head_from)
    return actor, critic


def _base_state(actor) -> dict:
    return {n: p.detach().clone() for n, p in unwrap(actor).named_parameters() if "lora_" not in n}


def _lora_b(module) -> float:
    return float(sum(p.detach().abs().sum() for n, p in module.named_parameters() if "lora_B" in n))


def test_shared_critic_owns_no_base_weights(tiny_model_path, dist_single):
    actor, critic = _pair(tiny_model_path, 0)
    base = [p for n, p in unwrap(actor).named_parameters() if "lora_" not in n]
    own = owned_parameters(critic.module, actor_decoder(actor))
    # what the critic adds to memory: its LoRA adapters and its value head, nothing of the base
    assert own and all("lora_" in n or n.startswith("value_head.") for n, _ in own), [n for n, _ in own]
    shared = [p for n, p in critic.module.named_parameters() if "lora_" not in n and not n.startswith("value_head.")]
    base_ptrs = {p.data_ptr() for p in base}
    assert shared and all(p.data_ptr() in base_ptrs for p in shared)  # the very tensors of the actor's base
    assert all(not p.requires_grad for p in shared)
    # the same trainable parameters as a separate LoRA critic, which holds a whole base of its own on top
    separate = build_critic(tiny_model_path, resolved("zero2", stage=0, lr=1e-3), init_from="actor",
                            attn_impl="sdpa", lora=LORA)
    assert sum(p.numel() for _, p in own) == sum(p.numel() for p in separate.module.parameters() if p.requires_grad)
    separate_ptrs = {p.data_ptr() for p in separate.module.parameters()}
    assert not separate_ptrs & base_ptrs
    # the optimizer holds the critic's own parameters only; the actor's tree did not get the critic's adapters
    assert {id(p) for g in critic.optimizer.param_groups for p in g["params"]} == {id(p) for _, p in own}
    assert all(".default." in n for n, _ in unwrap(actor).named_parameters() if "lora_" in n)
    assert sum("lora_" in n for n, _ in unwrap(actor).named_parameters()) == sum("lora_" in n for n, _ in own)


@pytest.mark.parametrize("stage", [0, 2])
def test_shared_critic_trains_without_touching_the_actor(tiny_model_path, dist_single, stage):
    from transformers import AutoModel, AutoModelForCausalLM

    actor, critic = _pair(tiny_model_path, stage)
    batch = lm_batch(0)
    reference = build_shared_reference(actor)
    # at the start the adapters are B = 0: the critic is the value head on the base model's hidden states
    assert _lora_b(critic.module) == 0
    plain = AutoModel.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    critic.eval()
    with torch.no_grad():
        start = critic(batch)
        torch.testing.assert_close(start, critic.module.value_head(plain(input_ids=batch).last_hidden_state)
                                   .squeeze(-1).float(), atol=1e-5, rtol=0)
    train_lm(actor, 0, 2)  # the actor's adapters move away from B = 0
    base_before = _base_state(actor)
    actor.train()
    with torch.no_grad():
        actor_before, _ = sequence_logprobs(actor, batch, MASK)
        critic.eval()
        after_actor_steps = critic(batch)
    torch.testing.assert_close(after_actor_steps, start, atol=0, rtol=0)  # the actor's steps are not the critic's
    critic.train()
    losses = train_critic(critic, 0, 4)
    assert losses[-1] < losses[0] and _lora_b(critic.module) > 0
    critic.eval()
    with torch.no_grad():
        assert (critic(batch) - start).abs().max() > 1e-3  # the critic learned
        actor_after, _ = sequence_logprobs(actor, batch, MASK)
        ref_logp, _ = sequence_logprobs(reference, batch, MASK)
        base_logp, _ = sequence_logprobs(AutoModelForCausalLM.from_pretrained(
            tiny_model_path, attn_implementation="sdpa").eval(), batch, MASK)
    for name, value in _base_state(actor).items():  # the shared base is bit for bit what it was
        assert torch.equal(value, base_before[name]), name
    torch.testing.assert_close(actor_after, actor_before, atol=0, rtol=0)  # the actor's adapter is active, alone
    torch.testing.assert_close(ref_logp, base_logp, atol=1e-6, rtol=0)  # adapters off: still the base model
    assert unwrap(actor).training and all(p.requires_grad for n, p in unwrap(actor).named_parameters()
                                          if "lora_" in n)
    assert train_lm(actor, 0, 1)  # and the actor keeps stepping after the critic's steps


def test_shared_critic_value_head_from_the_reward_model(tiny_model_path, tiny_reward_path, dist_single):
    from safetensors.torch import load_file

    _, critic = _pair(tiny_model_path, 0, head_from=tiny_reward_path)
    score = load_file(str(tiny_reward_path / "model.safetensors"))["score.weight"]
    torch.testing.assert_close(critic.module.value_head.weight.detach(), score.float(), atol=0, rtol=0)
    assert _lora_b(critic.module) == 0


def test_shared_critic_checkpoint_resumes(tiny_model_path, dist_single, tmp_path):
    """Save actor + critic, train on (A); fresh actor + shared critic, load both, train on (B): A == B."""
    from ds_rlhf.run.checkpoint.deepspeed_io import load_checkpoint, save_checkpoint

    actor, critic = _pair(tiny_model_path, 2)
    train_lm(actor, 0, 2)
    train_critic(critic, 0, 2)
    for role, engine in (("actor", actor), ("critic", critic)):
        save_checkpoint(engine, tmp_path / role, "step2")
    batch = lm_batch(0)
    tail_a = train_critic(critic, 0, 2)
    critic.eval()
    with torch.no_grad():
        values_a = critic(batch)
    actor_b, critic_b = _pair(tiny_model_path, 2)
    for role, engine in (("actor", actor_b), ("critic", critic_b)):
        load_checkpoint(engine, tmp_path / role, "step2")
    tail_b = train_critic(critic_b, 0, 2)
    critic_b.eval()
    with torch.no_grad():
        values_b = critic_b(batch)
    assert tail_b == pytest.approx(tail_a, abs=1e-6)
    torch.testing.assert_close(values_b, values_a, atol=1e-6, rtol=0)
    assert {p.data_ptr() for _, p in owned_parameters(critic_b.module, actor_decoder(actor_b))}.isdisjoint(
        p.data_ptr() for p in unwrap(actor_b).parameters() if not p.requires_grad)  # still sharing, not copying


def test_shared_critic_refuses_zero3(tiny_model_path, dist_single):
    actor = build_actor(tiny_model_path, resolved("zero2", stage=0), attn_impl="sdpa", lora=LORA)
    with pytest.raises(ConfigError, match="model.share_base") as err:
        build_shared_critic(actor, resolved("zero3", lr=1e-3), lora=LORA)
    assert "\n" not in str(err.value) and "--zero_stage 2" in str(err.value)


def test_shared_critic_exports_as_a_reward_model(tiny_model_path, dist_single, tmp_path):
    """The export merges the critic's adapters into (a copy of) the shared base: it loads as a reward model whose
    score at the last token is the critic's value there; the actor's base is left as it was."""
    from ds_rlhf.engines.hf_export import export_hf
    from ds_rlhf.engines.models import RewardModel

    actor, critic = _pair(tiny_model_path, 0)
    train_critic(critic, 0, 3)
    base_before = _base_state(actor)
    out = export_hf(critic, None, tmp_path / "critic")
    batch = lm_batch(0)
    critic.eval()
    with torch.no_grad():
        values = critic(batch)
        scores = RewardModel.from_pretrained(out, attn_impl="sdpa").eval()(input_ids=batch)
    torch.testing.assert_close(scores, values[:, -1], atol=1e-5, rtol=0)
    assert all(torch.equal(v, base_before[n]) for n, v in _base_state(actor).items())


def test_value_head_from_a_lora_rm_adapter_directory(tiny_model_path, tmp_path):
    """critic.init auto with a shared LoRA RM (a peft SEQ_CLS adapter dir, no model.safetensors): the value head
    is the adapter's trained score head (peft stores it as base_model.model.score.*), not an error."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from ds_rlhf.engines.shared_critic import score_head

    seqcls = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    peft = get_peft_model(seqcls, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        peft.base_model.model.score.modules_to_save["default"].weight.normal_()  # a "trained" head, not the init
    trained = peft.base_model.model.score.modules_to_save["default"].weight.detach().float().clone()
    peft.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    head = score_head(tmp_path, seqcls.config.hidden_size)
    torch.testing.assert_close(head.weight.detach(), trained, atol=0, rtol=0)
