"""The reward model with `model.lora_rank > 0` (the low-memory RM step): adapters on the backbone and the
score head train, the base stays as loaded, the preference rule is still learned, and the export is a plain
sequence-classification checkpoint (adapters merged) that scores exactly as the trained model. Beside it,
run_dir/export_adapter holds the same RM as a peft LoRA SEQ_CLS adapter of the RM run's `model.path`, which
`model.share_base` runs on the actor's own base (engines/shared_reward.py) with the trained RM's scores.

One RM run (`built_once`, as conftest's `rm_run`) serves every test here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.recipes.conftest import built_once, run_supervised

IDS = torch.tensor([[1, 5, 6, 7, 9, 4, 2], [1, 8, 9, 3, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9]])
ATTN = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def lora_rm(sft_run, addition_stores, tmp_path_factory, dist_single):
    """The LoRA RM run, once per test run (across xdist workers): its directory, and what the tests need of the
    trained model (its trainable names and sizes, its scores of IDS) recorded beside it."""
    from ds_rlhf.engines.models import unwrap
    from ds_rlhf.recipes.rm import RewardModelTask

    def build(out):
        trainer, summary = run_supervised(RewardModelTask(), [
            "--model.path", str(sft_run[0] / "export"), "--data.train", str(addition_stores["preference"]),
            "--data.eval_fraction", "0.1", "--run.output_dir", str(out), "--run.steps", "40", "--model.lora_rank",
            "8", "--model.lora_alpha", "16", "--optim.lr", "5e-3", "--optim.batch_size", "32",
            "--optim.micro_batch_size", "32", "--run.progress", "false", "--run.tensorboard", "false"])
        module = unwrap(trainer.engine).eval()
        with torch.no_grad():
            scores = module(input_ids=IDS, attention_mask=ATTN).float()
        return {"summary": summary, "scores": scores.tolist(),
                "trainable": {n: p.numel() for n, p in module.named_parameters() if p.requires_grad},
                "total": sum(p.numel() for p in module.parameters()),
                "lora": sum(1 for n, _ in module.named_parameters() if "lora_" in n)}

    out, built = built_once(tmp_path_factory, "rm_lora_run", build)
    return {**built, "out": out, "scores": torch.tensor(built["scores"]), "base": sft_run[0] / "export"}


def test_lora_reward_model_trains_adapters_and_exports_merged(lora_rm):
    from ds_rlhf.engines.models import RewardModel

    summary, out, trainable = lora_rm["summary"], lora_rm["out"], lora_rm["trainable"]
    assert trainable and all("lora_" in n or n.startswith("model.score.") for n in trainable), sorted(trainable)[:5]
    assert any(n.startswith("model.score.") for n in trainable)
    assert sum(trainable.values()) < 0.2 * lora_rm["total"]

    assert summary["eval_after"]["eval/accuracy"] > summary["eval_before"]["eval/accuracy"] + 0.1, summary

    export = out / "export"
    assert not (export / "adapter_config.json").exists()  # merged, not an adapter directory
    assert not any(p.is_dir() for p in export.iterdir())  # and nothing nested in it: a plain model directory
    plain = RewardModel.from_pretrained(export)
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS, ATTN), lora_rm["scores"], rtol=1e-4, atol=1e-4)


def test_lora_rm_adapter_export_is_a_peft_seqcls_adapter_of_its_base(lora_rm):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    from ds_rlhf.engines.models import RewardModel

    adapter, base = lora_rm["out"] / "export_adapter", lora_rm["base"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "SEQ_CLS", 8, 16)
    assert Path(config["base_model_name_or_path"]) == base.resolve()
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]  # all-linear of the backbone, as trained
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert len([k for k in keys if "lora_" in k]) == lora_rm["lora"] and "base_model.model.score.weight" in keys
    assert len(keys) == lora_rm["lora"] + 1  # adapters + score head, no base weight
    # an ordinary peft consumer: the adapter on a freshly loaded base scores as the trained RM
    seqcls = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    plain = RewardModel(PeftModel.from_pretrained(seqcls, str(adapter)).merge_and_unload()).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS, ATTN), lora_rm["scores"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 2])
def test_lora_rm_adapter_runs_on_the_actor_base(lora_rm, dist_single, stage):
    from ds_rlhf.engines.builder import build_actor
    from ds_rlhf.engines.shared_critic import actor_decoder, owned_parameters
    from ds_rlhf.engines.shared_reward import build_shared_reward, shared_reward_refusal
    from tests.engines.workers import resolved

    adapter, base = lora_rm["out"] / "export_adapter", lora_rm["base"]
    assert shared_reward_refusal(adapter, base, zero_stage=stage) is None
    assert "full model" in shared_reward_refusal(lora_rm["out"] / "export", base, zero_stage=stage)
    actor = build_actor(base, resolved("zero2", stage=stage), attn_impl="sdpa", lora={"r": 8, "lora_alpha": 32})
    reward = build_shared_reward(actor, adapter, resolved("zero2", stage=stage))
    own = owned_parameters(reward.module, actor_decoder(actor))
    assert own and all("lora_" in n or ".score." in n for n, _ in own), [n for n, _ in own]
    with torch.no_grad():
        scores = reward(input_ids=IDS, attention_mask=ATTN)
    torch.testing.assert_close(scores, lora_rm["scores"], rtol=0, atol=1e-5)


def test_grpo_with_the_lora_rm_adapter_on_a_shared_base(lora_rm, addition_stores, dist_single, tmp_path, capsys):
    from ds_rlhf.config import parse_config
    from ds_rlhf.engines.models import unwrap
    from ds_rlhf.engines.shared_critic import actor_decoder, owned_parameters
    from ds_rlhf.recipes.rl import RLTrainer

    adapter = lora_rm["out"] / "export_adapter"
    cfg = parse_config([
        "--model.path", str(lora_rm["base"]), "--model.lora_rank", "8", "--model.share_base", "true",
        "--zero_stage", "2", "--data.train", str(addition_stores["prompts"]), "--run.output_dir", str(tmp_path),
        "--run.steps", "2", "--rl.algo", "grpo", "--reward.model", str(adapter), "--eval.reward_fn",
        "math_shaped", "--rl.prompts_per_step", "4", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
        "--rollout.backend", "hf", "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf",
        "false"])
    trainer = RLTrainer(cfg)
    said = capsys.readouterr().out
    assert (f"[rl] model.share_base: the reward model is {adapter}'s LoRA adapters + score head on the actor's "
            "base, no copy of its own") in said, said
    reward = unwrap(trainer.parts.reward.model)
    assert len(owned_parameters(reward, actor_decoder(trainer.parts.actor))) < len(list(reward.parameters()))
    history = trainer.train()
    assert len(history) == 2 and all("reward/mean" in h for h in history), history


def test_ds_rlhf_export_of_a_lora_rm_checkpoint_is_merged(lora_rm, tmp_path):
    """`ds-rlhf export` rebuilds the RM as the trainer built it (LoRA on the backbone), so a LoRA RM checkpoint
    exports merged and scores as the trained model (the adapters' keys load)."""
    from ds_rlhf.engines.models import RewardModel
    from ds_rlhf.entrypoints.export import export_checkpoint

    step = sorted((lora_rm["out"] / "checkpoints").glob("step_*"))[-1]
    out = export_checkpoint(step, tmp_path / "hf", dtype="fp32")
    plain = RewardModel.from_pretrained(out)
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS, ATTN), lora_rm["scores"], rtol=1e-4, atol=1e-4)
