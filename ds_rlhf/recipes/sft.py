"""SFT: next-token loss on assistant tokens only, over packed padding-free micro-batches.

Rows of an `sft` store carry `input_ids` and `loss_mask` (1 on assistant tokens and their end-of-turn token).
Position t of the packed row predicts token t+1, which is trained exactly when `loss_mask[t+1]` is 1; the first
token of every sequence is never a target, so no loss crosses a packing boundary.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ds_rlhf.data.packing import pack_sequences
from ds_rlhf.engines.builder import build_actor
from ds_rlhf.engines.hf_export import export_hf
from ds_rlhf.engines.models import lora_settings
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.recipes.batching import split_micro
from ds_rlhf.run.context import RunContext


def pack_rows(rows: list[dict], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, N], position_ids [1, N], target mask [N-1]) for a packed micro-batch."""
    packed = pack_sequences([list(r["input_ids"]) for r in rows])
    masks = []
    for r in rows:
        m = torch.as_tensor(list(r["loss_mask"]), dtype=torch.float32)
        m[0] = 0.0  # a sequence's first token has no prefix in this sequence
        masks.append(m)
    target_mask = torch.cat(masks)[1:]
    return packed["input_ids"].to(device), packed["position_ids"].to(device), target_mask.to(device)


def masked_nll_sum(engine, rows: list[dict], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood over trained tokens, and the number of trained tokens."""
    input_ids, position_ids, mask = pack_rows(rows, device)
    logp, _ = sequence_logprobs(engine, input_ids, None, position_ids=position_ids)
    return -(logp[0] * mask).sum(), mask.sum()


def token_budget_groups(ctx: RunContext, rows: list[dict], lengths: list[int], *,
                        padded: bool) -> list[list[dict]]:
    """Micro-batches by token budget (or fixed size), the same count on every rank; some may be empty."""
    groups = split_micro(lengths, max_tokens=ctx.cfg.data.micro_batch_tokens,
                         max_rows=max(1, ctx.cfg.optim.micro_batch_size), padded=padded, device=ctx.dist.device)
    return [[rows[i] for i in group] for group in groups]


class SFTTask:
    name = "sft"
    store_kind = "sft"
    progress_keys = ("train/loss", "eval/loss")

    def build(self, ctx: RunContext, ds_config: dict):
        cfg = ctx.cfg
        lora = lora_settings(cfg.model)
        return build_actor(ctx.model_path, ds_config, attn_impl=cfg.model.attn_impl,
                           gradient_checkpointing=cfg.model.gradient_checkpointing, lora=lora,
                           quantize=cfg.model.quantize_base, kernels=cfg.model.kernels)

    def micro_batches(self, ctx: RunContext, rows: list[dict]) -> list[list[dict]]:
        return token_budget_groups(ctx, rows, [len(r["input_ids"]) for r in rows], padded=False)

    def count(self, rows: list[dict]) -> float:
        return float(sum(sum(r["loss_mask"][1:]) for r in rows))

    def loss_terms(self, engine, ctx: RunContext, rows: list[dict]):
        loss_sum, n = masked_nll_sum(engine, rows, ctx.dist.device)
        return loss_sum, {"train/loss": loss_sum.detach() / n.clamp(min=1)}

    def evaluate(self, engine, ctx: RunContext, rows: list[dict]) -> dict:
        total, count = 0.0, 0.0
        for group in self.micro_batches(ctx, rows):
            loss_sum, n = masked_nll_sum(engine, group or rows[:1], ctx.dist.device)
            if not group:
                continue
            total, count = total + float(loss_sum), count + float(n)
        loss = total / max(count, 1.0)
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}

    def export(self, engine, ctx: RunContext, out_dir: Path) -> None:
        export_hf(engine, ctx.tokenizer, out_dir)
