"""Engines at world size 1 (in-process gloo): builders, frozen roles, export from ZeRO-3, checkpoints, bf16 on CPU."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.engines.builder import build_actor, build_critic, build_engine, build_reference, build_reward
from ds_rlhf.engines.hf_export import export_hf
from ds_rlhf.engines.models import CriticModel, RewardModel
from ds_rlhf.engines.roles import role_info
from ds_rlhf.run.checkpoint.deepspeed_io import load_checkpoint, save_checkpoint
from tests.engines.workers import lm_batch, resolved, train_critic, train_lm

TOL = 1e-5  # fp32 engine vs plain HF module on the same weights


def test_actor_zero3_lora_gc_trains_and_exports(tiny_model_path, tiny_tokenizer, dist_single, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = build_actor(tiny_model_path, resolved("zero3", world_size=1), attn_impl="sdpa",
                         gradient_checkpointing=True, lora={"r": 8, "lora_alpha": 32})
    assert engine.module.base_model.model.is_gradient_checkpointing
    losses = train_lm(engine, 0, 6)
    assert losses[-1] < losses[0] - 0.1, losses
    batch = lm_batch(0)
    out = export_hf(engine, tiny_tokenizer, tmp_path / "actor")
    assert (out / "ds_config.resolved.json").exists() and (out / "tokenizer.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
    assert not any("lora" in k for k in exported.state_dict())
    with torch.no_grad():
        engine.eval()
        torch.testing.assert_close(exported(input_ids=batch).logits, engine(input_ids=batch).logits,
                                   atol=1e-4, rtol=0)  # LoRA merged in fp32: a little more rounding


def test_critic_trains_and_exports_as_reward_model(tiny_reward_path, tiny_tokenizer, dist_single, tmp_path):
    engine = build_critic(tiny_reward_path, resolved("zero2", world_size=1, lr=1e-3), attn_impl="sdpa")
    losses = train_critic(engine, 0, 6)
    assert min(losses[-2:]) < 0.5 * losses[0], losses
    out = export_hf(engine, tiny_tokenizer, tmp_path / "critic")
    batch = lm_batch(0)
    with torch.no_grad():
        values = engine(batch)
        torch.testing.assert_close(RewardModel.from_pretrained(out)(batch), values[:, -1], atol=TOL, rtol=0)
        torch.testing.assert_close(CriticModel.from_pretrained(out, "reward")(batch), values, atol=TOL, rtol=0)


@pytest.mark.parametrize("offload", [False, True])
def test_frozen_roles_zero3_match_plain_models(tiny_model_path, tiny_reward_path, dist_single, offload):
    from transformers import AutoModelForCausalLM

    cfg = resolved("zero3", world_size=1)
    ref = build_reference(tiny_model_path, cfg, attn_impl="sdpa", offload=offload)
    reward = build_reward(tiny_reward_path, cfg, attn_impl="sdpa", offload=offload)
    for engine in (ref, reward):
        assert engine.optimizer is not None and not role_info(engine).trainable  # ZeRO-Inference wrapper, no Adam
        assert all(not p.requires_grad for p in engine.module.parameters())
        assert all(p.numel() == 0 or getattr(p, "ds_numel", None) for p in engine.module.parameters())
    assert role_info(ref).ds_config["zero_optimization"].get("offload_param", {}).get("device", "none") == (
        "cpu" if offload else "none")
    batch = lm_batch(0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa")
    plain_rm = RewardModel.from_pretrained(tiny_reward_path, attn_impl="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=batch).logits, plain(input_ids=batch).logits, atol=TOL, rtol=0)
        torch.testing.assert_close(reward(batch), plain_rm(batch), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="frozen"):
        save_checkpoint(ref, "unused", "t")


@pytest.mark.parametrize("config", ["zero3", "zero3_offload"])
def test_zero3_partitions_parameter_by_parameter(tiny_model_path, dist_single, monkeypatch, config):
    """ZeRO-3 engines are partitioned before `deepspeed.initialize` (builder.partition_zero3), which otherwise
    moves the whole module to the accelerator first (a 15 GiB transient for the 8B shape on the H200). The module
    is never moved whole, every parameter is partitioned (offloaded: its shard in host memory), and the engine
    computes what the plain model computes."""
    from ds_rlhf.engines import builder
    from ds_rlhf.engines.models import load_causal_lm

    model = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa")
    plain = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa").eval()
    moved = []
    monkeypatch.setattr(model, "to", lambda *a, **k: moved.append((a, k)) or model)
    engine = build_engine(model, resolved(config, world_size=1), role="actor", trainable=True)
    assert moved == []
    params = list(engine.module.parameters())
    assert params and all(hasattr(p, "ds_id") and p.ds_tensor.device.type == "cpu" for p in params)
    if config == "zero3_offload":
        assert engine.zero_offload_param()
    batch = lm_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(engine.module.eval()(input_ids=batch).logits, plain(input_ids=batch).logits,
                                   atol=TOL, rtol=0)
    assert builder.partition_zero3(model, resolved(config, world_size=1)) is None  # already partitioned: no-op


def test_bf16_on_cpu_trains(tiny_model_path, dist_single):
    engine = build_actor(tiny_model_path, resolved("zero2", world_size=1, precision="bf16"), attn_impl="sdpa")
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    losses = train_lm(engine, 0, 5)
    assert losses[-1] < losses[0] - 0.5, losses


def test_checkpoint_resume_equals_uninterrupted_ws1(tiny_model_path, dist_single, tmp_path):
    cfg = resolved("zero3_offload", world_size=1, warmup_steps=5)
    a = build_actor(tiny_model_path, cfg, attn_impl="sdpa")
    train_lm(a, 0, 3, vary=True)
    save_checkpoint(a, tmp_path, "s3", {"step": 3, "note": "x"})
    assert (tmp_path / "s3" / "ds_config.resolved.json").exists()
    tail_a = train_lm(a, 0, 3, start=3, vary=True)
    b = build_actor(tiny_model_path, cfg, attn_impl="sdpa")
    assert load_checkpoint(b, tmp_path, "s3") == {"step": 3, "note": "x"}
    tail_b = train_lm(b, 0, 3, start=3, vary=True)
    assert tail_a == tail_b  # bit-identical losses
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(pa.ds_tensor, pb.ds_tensor), name
    with pytest.raises(FileNotFoundError):
        load_checkpoint(b, tmp_path, "missing")


@pytest.mark.parametrize("stage", [0, 2])
def test_lora_checkpoint_holds_what_trains_and_resumes_exactly(tiny_model_path, dist_single, tmp_path, stage):
    """A LoRA actor's checkpoint leaves its frozen base out (it is rebuilt from model.path on resume): the files
    are a fraction of a full one, a resume is bit-identical, and a checkpoint missing a trained tensor is refused."""
    from pathlib import Path

    from ds_rlhf.run.checkpoint.deepspeed_io import FROZEN_FILE

    cfg = resolved("zero2", stage=stage, warmup_steps=5)
    lora = {"r": 8, "lora_alpha": 16}
    a = build_actor(tiny_model_path, cfg, attn_impl="sdpa", lora=lora)
    train_lm(a, 0, 3, vary=True)
    save_checkpoint(a, tmp_path / "lora", "s3", {"step": 3})
    tail_a = train_lm(a, 0, 3, start=3, vary=True)
    b = build_actor(tiny_model_path, cfg, attn_impl="sdpa", lora=lora)
    assert load_checkpoint(b, tmp_path / "lora", "s3") == {"step": 3}
    assert train_lm(b, 0, 3, start=3, vary=True) == tail_a  # bit-identical losses
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(pa, pb), name

    marker = tmp_path / "lora" / "s3" / FROZEN_FILE
    import json

    excluded = json.loads(marker.read_text())["excluded"]
    frozen = {n for n, p in a.module.named_parameters() if not p.requires_grad}
    assert set(excluded) == frozen and frozen
    from ds_rlhf.run.checkpoint import deepspeed_io

    real, deepspeed_io.excludable_frozen = deepspeed_io.excludable_frozen, lambda engine: []
    try:  # the same LoRA engine saved the old way, base included
        save_checkpoint(a, tmp_path / "with_base", "s6")
    finally:
        deepspeed_io.excludable_frozen = real
    assert not (tmp_path / "with_base" / "s6" / FROZEN_FILE).exists()

    def files_bytes(d: Path) -> int:
        return sum(f.stat().st_size for f in d.rglob("*.pt"))

    base_bytes = sum(p.numel() * p.element_size() for n, p in a.module.named_parameters() if n in frozen)
    saved = files_bytes(tmp_path / "with_base" / "s6") - files_bytes(tmp_path / "lora" / "s3")
    # the base's weights are left out; DeepSpeed still writes a tied head under its second name (lm_head.weight
    # of the tiny model, its embeddings: 18% of this base, none of an untied model such as Llama-3 8B's)
    assert 0.75 * base_bytes < saved <= 1.05 * base_bytes, (saved, base_bytes)

    marker.write_text(json.dumps({"excluded": sorted(frozen - {excluded[0]})}))  # one frozen name "trained" now
    c = build_actor(tiny_model_path, cfg, attn_impl="sdpa", lora=lora)
    with pytest.raises(RuntimeError, match="missing"):
        load_checkpoint(c, tmp_path / "lora", "s3")


def test_onebit_rejected_at_zero_stage_above_0(tiny_model_path, dist_single):
    from ds_rlhf.engines.models import load_causal_lm

    cfg = resolved("onebit_adam", world_size=1, freeze_step=2)
    cfg["zero_optimization"] = {"stage": 2}
    model = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa")
    with pytest.raises(ValueError, match="ZeRO stage 0"):
        build_engine(model, cfg, role="actor")
    with pytest.raises(ValueError, match="resolved"):
        build_engine(model, {"train_batch_size": "auto"}, role="actor")


def test_zero_plus_plus_on_cpu_is_reported_not_hidden(tiny_model_path, dist_single):
    """ZeRO++ quantisation kernels exist only for CUDA; on CPU DeepSpeed must fail loudly at build time."""
    if torch.cuda.is_available():
        pytest.skip("GPU present: the GPU path is exercised by bench/engines_gpu.py")
    with pytest.raises(Exception, match="not been implemented on CPU|CPU"):
        engine = build_actor(tiny_model_path, resolved("zero3_pp", world_size=1), attn_impl="sdpa")
        train_lm(engine, 0, 1)
