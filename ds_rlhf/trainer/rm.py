"""Reward model: Bradley-Terry pairwise loss, score read at the last non-pad token.

loss = -log sigmoid(r(chosen) - r(rejected) - margin)  (Ouyang et al. 2022, eq. 1; margin as in Llama 2).
The export is a sequence-classification checkpoint, so `train_ppo.py` loads it as `--rl.reward_model` and as the
critic's initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ds_rlhf.trainer.batching import pad_right
from ds_rlhf.trainer.run_context import RunContext
from ds_rlhf.trainer.sft import token_budget_groups


def pair_scores(engine, rows: list[dict], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected, in one forward over both halves."""
    seqs = [list(r["chosen_ids"]) for r in rows] + [list(r["rejected_ids"]) for r in rows]
    ids, attn = pad_right(seqs, pad_id, device)
    scores = engine(input_ids=ids, attention_mask=attn).float()
    return scores[: len(rows)], scores[len(rows) :]


def add_backbone_lora(model, lora: dict) -> None:
    """`model.lora_rank > 0` for the reward model: LoRA adapters on its backbone (the transformer), the score head
    trained in full (it is one hidden-size row). The frozen backbone then needs no gradients or Adam states, as for
    the LoRA actor; the export merges the adapters (a plain sequence-classification checkpoint, `engine_io`)."""
    from ds_rlhf.engines.models import apply_lora

    seqcls = model.model
    prefix = seqcls.base_model_prefix
    setattr(seqcls, prefix, apply_lora(getattr(seqcls, prefix), lora, None))
    for p in seqcls.score.parameters():
        p.requires_grad_(True)


class RewardModelTask:
    name = "rm"
    store_kind = "preference"
    progress_keys = ("train/loss", "train/accuracy", "eval/accuracy")

    def __init__(self, margin: float = 0.0):
        self.margin = margin

    def build(self, ctx: RunContext, ds_config: dict):
        from ds_rlhf.engines.builder import build_engine
        from ds_rlhf.engines.ds_config import config_precision
        from ds_rlhf.engines.models import RewardModel, lora_settings

        # fp32 master weights; DeepSpeed casts for bf16/fp16 compute as the ds_config says
        model = RewardModel.from_pretrained(ctx.model_path, dtype="fp32", attn_impl=ctx.cfg.model.attn_impl,
                                            compute_dtype=config_precision(ds_config))
        if ctx.cfg.model.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        lora = lora_settings(ctx.cfg.model)
        if lora:
            add_backbone_lora(model, lora)
        return build_engine(model, ds_config, role="reward", trainable=True)

    def micro_batches(self, ctx: RunContext, rows: list[dict]) -> list[list[dict]]:
        lengths = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
        return token_budget_groups(ctx, rows, lengths, padded=True)

    def count(self, rows: list[dict]) -> float:
        return float(len(rows))

    def loss_terms(self, engine, ctx: RunContext, rows: list[dict]):
        chosen, rejected = pair_scores(engine, rows, ctx.tokenizer.pad_token_id, ctx.dist.device)
        losses = -F.logsigmoid(chosen - rejected - self.margin)
        return losses.sum(), {"train/loss": losses.mean().detach(),
                              "train/accuracy": (chosen > rejected).float().mean(),
                              "train/margin": (chosen - rejected).mean().detach()}

    def evaluate(self, engine, ctx: RunContext, rows: list[dict]) -> dict:
        correct, loss, n = 0.0, 0.0, 0
        for group in self.micro_batches(ctx, rows):
            chosen, rejected = pair_scores(engine, group or rows[:1], ctx.tokenizer.pad_token_id, ctx.dist.device)
            if not group:
                continue
            correct += float((chosen > rejected).sum())
            loss += float(-F.logsigmoid(chosen - rejected - self.margin).sum())
            n += len(group)
        return {"eval/accuracy": correct / max(n, 1), "eval/loss": loss / max(n, 1)}

    def export(self, engine, ctx: RunContext, out_dir: Path) -> None:
        from ds_rlhf.engines.engine_io import export_hf

        export_hf(engine, ctx.tokenizer, out_dir)
