"""Reward model: Bradley-Terry pairwise loss, score read at the score token: each sequence is ended with exactly one
end-of-turn token of the run's tokenizer (`engines/rm_scoring.py`), the position RL scoring and the export read too.

loss = -log sigmoid(r(chosen) - r(rejected) - margin)  (Ouyang et al. 2022, eq. 1; margin as in Llama 2).
The export is a sequence-classification checkpoint, so `train_ppo.py` loads it as `--reward.model` and as the
critic's initialisation. With `model.lora_rank` the run also writes run_dir/export_adapter: the RM as a peft LoRA
SEQ_CLS adapter of its `model.path`, which `--model.share_base true` runs on the actor's base without a copy.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ds_rlhf.engines.builder import build_engine, load_dtypes
from ds_rlhf.engines.hf_export import export_hf, export_reward_adapter
from ds_rlhf.engines.models import RewardModel, apply_seqcls_lora, lora_settings
from ds_rlhf.engines.rm_scoring import ScoreRule, score_rule
from ds_rlhf.recipes.batching import pad_right, pad_scored
from ds_rlhf.recipes.sft import token_budget_groups
from ds_rlhf.run.context import RunContext


def pair_scores(engine, rows: list[dict], pad_id: int, device, rule: ScoreRule | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected, in one forward over both halves, each read at its last token: with `rule`,
    each sequence is first ended at its score token (`rm_scoring.score_ids`, as RM training and evaluation do);
    without, the sequences are scored as given."""
    seqs = [list(r["chosen_ids"]) for r in rows] + [list(r["rejected_ids"]) for r in rows]
    ids, attn = pad_right(seqs, pad_id, device) if rule is None else pad_scored(seqs, rule, pad_id, device)
    scores = engine(input_ids=ids, attention_mask=attn).float()
    return scores[: len(rows)], scores[len(rows) :]


def pair_correct(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair, 1 where chosen outscores rejected, 0.5 for a tie (an RM run starts with its head at zero, scoring
    every pair a tie: accuracy 0.5, the no-preference baseline), else 0."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class RewardModelTask:
    name = "rm"
    store_kind = "preference"
    progress_keys = ("train/loss", "train/accuracy", "eval/accuracy")

    def __init__(self, margin: float = 0.0):
        self.margin = margin
        self._rule: ScoreRule | None = None

    def rule(self, ctx: RunContext) -> ScoreRule:
        """The run tokenizer's score rule (`engines/rm_scoring.py`), computed once."""
        if self._rule is None:
            self._rule = score_rule(ctx.tokenizer)
        return self._rule

    def build(self, ctx: RunContext, ds_config: dict):
        # fp32 master weights (a LoRA RM's frozen backbone in the compute dtype); DeepSpeed casts as the ds_config says
        lora = lora_settings(ctx.cfg.model)
        model = RewardModel.from_pretrained(ctx.model_path, attn_impl=ctx.cfg.model.attn_impl,
                                            kernels=ctx.cfg.model.kernels, new_head=True,
                                            **load_dtypes(ds_config, True, lora=lora))
        if ctx.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if lora:
            apply_seqcls_lora(model.model, lora)
        return build_engine(model, ds_config, role="reward", trainable=True)

    def micro_batches(self, ctx: RunContext, rows: list[dict]) -> list[list[dict]]:
        lengths = [len(r["chosen_ids"]) + len(r["rejected_ids"]) + 2 for r in rows]  # the rule adds <= 1 token each
        return token_budget_groups(ctx, rows, lengths, padded=True)

    def count(self, rows: list[dict]) -> float:
        return float(len(rows))

    def loss_terms(self, engine, ctx: RunContext, rows: list[dict]):
        chosen, rejected = pair_scores(engine, rows, ctx.tokenizer.pad_token_id, ctx.dist.device, self.rule(ctx))
        losses = -F.logsigmoid(chosen - rejected - self.margin)
        return losses.sum(), {"train/loss": losses.mean().detach(),
                              "train/accuracy": pair_correct(chosen, rejected).mean(),
                              "train/margin": (chosen - rejected).mean().detach()}

    def evaluate(self, engine, ctx: RunContext, rows: list[dict]) -> dict:
        correct, loss, n = 0.0, 0.0, 0
        for group in self.micro_batches(ctx, rows):
            chosen, rejected = pair_scores(engine, group or rows[:1], ctx.tokenizer.pad_token_id, ctx.dist.device,
                                           self.rule(ctx))
            if not group:
                continue
            correct += float(pair_correct(chosen, rejected).sum())
            loss += float(-F.logsigmoid(chosen - rejected - self.margin).sum())
            n += len(group)
        return {"eval/accuracy": correct / max(n, 1), "eval/loss": loss / max(n, 1)}

    def export(self, engine, ctx: RunContext, out_dir: Path) -> None:
        """`out_dir` (run_dir/export): the RM as a plain sequence-classification checkpoint (LoRA merged). With
        `model.lora_rank`, also `adapter_dir(out_dir)`: the same RM as a peft LoRA SEQ_CLS adapter of the run's
        `model.path` (adapters + score head), which PPO's `model.share_base` runs on the actor's own base."""
        import shutil

        export_hf(engine, ctx.tokenizer, out_dir)
        adapter = adapter_dir(out_dir)
        if ctx.cfg.model.lora_rank > 0:
            export_reward_adapter(engine, ctx.tokenizer, adapter, Path(ctx.model_path).resolve())
            ctx.print(f"[rm] LoRA adapters + score head of {ctx.model_path} exported to {adapter} (for "
                      f"--model.share_base true --reward.model {adapter})")
        elif ctx.dist.is_main and adapter.exists():  # an earlier LoRA run's adapter is not this model
            shutil.rmtree(adapter)


def adapter_dir(export_dir: str | Path) -> Path:
    """Where a LoRA RM's adapter directory goes: beside the merged export (run_dir/export_adapter), so that
    run_dir/export stays a plain full model."""
    export_dir = Path(export_dir)
    return export_dir.with_name(f"{export_dir.name}_adapter")
