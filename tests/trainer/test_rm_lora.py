"""The reward model with `model.lora_rank > 0` (issue 16's low-memory RM step): adapters on the backbone and the
score head train, the base stays as loaded, the preference rule is still learned, and the export is a plain
sequence-classification checkpoint (adapters merged) that scores exactly as the trained model."""

from __future__ import annotations

import torch

from tests.trainer.conftest import run_supervised


def test_lora_reward_model_trains_adapters_and_exports_merged(sft_run, addition_stores, tmp_path):
    from ds_rlhf.engines.models import RewardModel, unwrap
    from ds_rlhf.trainer.rm import RewardModelTask

    out = tmp_path / "rm_lora"
    trainer, summary = run_supervised(RewardModelTask(), [
        "--model.path", str(sft_run[0] / "export"), "--data.train", str(addition_stores["preference"]),
        "--data.eval_fraction", "0.1", "--run.output_dir", str(out), "--run.steps", "40", "--model.lora_rank", "8",
        "--model.lora_alpha", "16", "--optim.lr", "5e-3", "--optim.batch_size", "32", "--optim.micro_batch_size",
        "32", "--run.progress", "false", "--run.tensorboard", "false"])
    module = unwrap(trainer.engine)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("model.score.") for n in trainable), sorted(trainable)[:5]
    assert any(n.startswith("model.score.") for n in trainable)
    total = sum(p.numel() for p in module.parameters())
    assert sum(p.numel() for n, p in module.named_parameters() if n in trainable) < 0.2 * total

    assert summary["eval_after"]["eval/accuracy"] > summary["eval_before"]["eval/accuracy"] + 0.1, summary

    export = out / "export"
    assert not (export / "adapter_config.json").exists()  # merged, not an adapter directory
    plain = RewardModel.from_pretrained(export)
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    ids = torch.tensor([[1, 5, 6, 7, 9], [1, 8, 9, 3, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, attn), module(input_ids=ids, attention_mask=attn).float(),
                                   rtol=1e-4, atol=1e-4)
