"""ds_config resolution: every "auto" filled from the CLI the way HF/accelerate do, conflicts named, DeepSpeed accepts
the result."""

from __future__ import annotations

import json
import logging

import pytest

from ds_rlhf.ds_config_file import load_ds_config
from ds_rlhf.engines.ds_config import find_auto, pick_precision, resolve_ds_config, save_resolved_config

FILES = ["zero2", "zero3", "zero3_offload", "zero3_pp", "onebit_adam"]
CLI = dict(micro_batch_size=4, grad_accum=2, world_size=2, precision="bf16", grad_clip=0.5, lr=3e-4,
           weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, warmup_steps=10, total_steps=200)


@pytest.mark.parametrize("name", FILES)
def test_every_config_resolves_without_auto(name):
    raw = load_ds_config(name)
    assert find_auto(raw), f"{name} should use 'auto' for run-dependent values"
    cfg = resolve_ds_config(raw, **CLI, hidden_size=64)
    assert find_auto(cfg) == []
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == 4 * 2 * 2
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.1 and cfg["optimizer"]["params"]["eps"] == 1e-6
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 10
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert raw != cfg and find_auto(raw), "resolution must not modify its input"


def test_config_specifics():
    off = resolve_ds_config(load_ds_config("zero3_offload"), **CLI)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["zero_optimization"]["offload_param"]["device"] == "cpu"
    pp = resolve_ds_config(load_ds_config("zero3_pp"), **CLI)
    assert pp["zero_optimization"]["zero_quantized_weights"] and pp["zero_optimization"]["zero_quantized_gradients"]
    assert pp["zero_optimization"]["zero_hpz_partition_size"] == 1  # single node: no secondary partition
    ob = resolve_ds_config(load_ds_config("onebit_adam"), **CLI)
    assert ob["optimizer"]["type"] == "OneBitAdam" and ob["zero_optimization"]["stage"] == 0
    assert ob["optimizer"]["params"]["freeze_step"] == 30  # 15% of 200 total steps
    z3 = resolve_ds_config(load_ds_config("zero3"), **CLI, hidden_size=64)
    assert z3["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert z3["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_explicit_file_value_wins_over_a_default_with_a_warning(caplog):
    raw = load_ds_config("zero2")
    raw["train_micro_batch_size_per_gpu"] = 8
    with caplog.at_level(logging.WARNING):
        cfg = resolve_ds_config(raw, **CLI)
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and cfg["train_batch_size"] == 8 * 2 * 2
    assert "overrides the run's default" in caplog.text


def test_explicit_zero_stage_overrides_the_file(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = resolve_ds_config(load_ds_config("zero2"), **CLI, zero_stage=3)
    assert cfg["zero_optimization"]["stage"] == 3
    assert "overrides ds_config zero_optimization.stage=2" in caplog.text


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c.update(train_batch_size=7), "train_batch_size"),
    (lambda c: c.update(bf16={"enabled": True}, fp16={"enabled": True}), "fp16.enabled"),
    (lambda c: c["zero_optimization"].update(stage=2, offload_param={"device": "cpu"}), "offload_param"),
    (lambda c: c.update(unknown_knob="auto"), "unknown_knob"),
    (lambda c: c["zero_optimization"].update(stage="auto"), "zero_optimization.stage"),
])
def test_conflicts_raise_naming_the_key(mutate, key):
    raw = load_ds_config("zero2")
    mutate(raw)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        resolve_ds_config(raw, **CLI)


def test_onebit_refuses_zero_stages_and_needs_total_steps():
    raw = load_ds_config("onebit_adam")
    raw["zero_optimization"]["stage"] = "auto"
    with pytest.raises(ValueError, match="ZeRO stage 0.*partition"):
        resolve_ds_config(raw, **CLI, zero_stage=2)
    with pytest.raises(ValueError, match="freeze_step"):
        resolve_ds_config(load_ds_config("onebit_adam"), **{**CLI, "total_steps": None})


def test_offload_and_scheduler_rules():
    raw = load_ds_config("zero3")
    cfg = resolve_ds_config(raw, **CLI, offload=True)
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    raw2 = load_ds_config("zero2")
    raw2["zero_optimization"]["stage"] = "auto"
    with pytest.raises(ValueError, match="offload"):
        resolve_ds_config(raw2, **CLI, zero_stage=0, offload=True)
    no_warmup = resolve_ds_config(load_ds_config("zero2"), **{**CLI, "warmup_steps": 0})
    assert "scheduler" not in no_warmup  # DeepSpeed's WarmupLR rejects 0 steps; constant LR instead


def test_precision_choice_on_cpu():
    assert pick_precision("auto") == "fp32"
    assert pick_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        pick_precision("fp16")
    cfg = resolve_ds_config(load_ds_config("zero2"), **{**CLI, "precision": "auto"})
    assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]


def test_saved_config_round_trips(tmp_path):
    cfg = resolve_ds_config(load_ds_config("zero3"), **CLI)
    path = save_resolved_config(cfg, tmp_path / "ckpt")
    assert json.loads(path.read_text()) == cfg
    with pytest.raises(ValueError, match="unresolved"):
        save_resolved_config(load_ds_config("zero3"), tmp_path)


@pytest.mark.parametrize("name", FILES)
def test_deepspeed_accepts_resolved_configs(name, dist_single):
    """Raw DeepSpeed parses each resolved file (it rejects any left-over "auto")."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = resolve_ds_config(load_ds_config(name), **{**CLI, "world_size": 1})
    if name == "onebit_adam":
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}  # ours, passed as a client optimizer
    parsed = DeepSpeedConfig(cfg)
    assert parsed.train_batch_size == 8
    assert parsed.zero_optimization_stage == cfg["zero_optimization"]["stage"]
