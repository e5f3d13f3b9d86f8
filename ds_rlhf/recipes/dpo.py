"""DPO: the policy trained directly on a `preference` store's chosen/rejected pairs, no reward model, no rollouts.

A pair's two sequences are full chat-templated conversations; its response is what follows their longest common
prefix (the prompt), up to the final end-of-turn token (the chat template's tail after it, ChatML's `\\n`, is not
scored, as SFT does not train it). Each micro-batch packs the chosen and rejected sequences of its pairs into one
padding-free row; the chunked log-prob head (`engines/policy_forward.py:sequence_logprobs`) scores only the response
positions, summed per sequence. The reference is the starting model: a frozen copy (`engines/builder.py:
build_reference`), or with `model.lora_rank` the actor with its adapters disabled (`engines/shared_base.py`, no
copy), run on the fly per micro-batch; with `dpo.precompute_ref` its log-probs of every row are computed once at the
start (`DPOTask.prepare`), kept by store index, and the frozen copy is released. The loss is the `dpo.loss` entry of
`algos/preference.py` (DPO, cDPO, IPO, SimPO-style length normalisation and margin).

The export (run_dir/export) is a causal LM like SFT's: train_ppo.py's `--model.path`.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ds_rlhf.algos.preference import log_ratios, preference_loss
from ds_rlhf.data.packing import pack_sequences
from ds_rlhf.engines.builder import build_actor, build_reference, build_shared_reference
from ds_rlhf.engines.chat_tokens import end_of_turn_id, turn_tail_ids
from ds_rlhf.engines.hf_export import export_hf
from ds_rlhf.engines.models import lora_settings
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.recipes.sft import token_budget_groups
from ds_rlhf.run.context import RunContext

METRICS = ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def response_span(ids: list[int], prompt_len: int, eot_id: int | None, tail: tuple[int, ...]) -> tuple[int, int]:
    """[start, end) of the scored response tokens of `ids`: from `prompt_len` (at least 1: the first token has no
    prefix) to the end, less the chat template's `tail` when it follows a final `eot_id`."""
    end = len(ids)
    n = len(tail)
    if n and end > n and tuple(ids[end - n:]) == tail and ids[end - n - 1] == eot_id:
        end -= n
    start = max(1, prompt_len)
    return start, max(start, end)


def pair_spans(rows: list[dict], eot_id: int | None, tail: tuple[int, ...]) -> list[tuple[list[int], int, int]]:
    """For every row, (chosen ids, start, end) then (rejected ids, start, end): the packed sequences in order."""
    out = []
    for r in rows:
        chosen, rejected = list(r["chosen_ids"]), list(r["rejected_ids"])
        p = common_prefix(chosen, rejected)
        for ids in (chosen, rejected):
            out.append((ids, *response_span(ids, p, eot_id, tail)))
    return out


def response_logps(model, spans: list[tuple[list[int], int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-prob of each sequence's response tokens under `model` ([S]) and their count ([S]), from one packed
    padding-free forward; only response positions go through the output head."""
    packed = pack_sequences([ids for ids, _, _ in spans])
    masks, segments = [], []
    for k, (ids, start, end) in enumerate(spans):
        m = torch.zeros(len(ids))
        m[start:end] = 1.0
        masks.append(m)
        segments.append(torch.full((len(ids),), k, dtype=torch.long))
    mask = torch.cat(masks)[1:].to(device)  # position t predicts token t + 1
    seg = torch.cat(segments)[1:].to(device)
    logp, _ = sequence_logprobs(model, packed["input_ids"].to(device), None,
                                position_ids=packed["position_ids"].to(device), score_mask=mask.bool()[None])
    sums = torch.zeros(len(spans), dtype=logp.dtype, device=device).index_add(0, seg, logp[0] * mask)
    counts = torch.zeros(len(spans), device=device).index_add(0, seg, mask)
    return sums, counts


class DPOTask:
    name = "dpo"
    store_kind = "preference"
    progress_keys = ("dpo/loss", "rewards/accuracy", "eval/rewards/accuracy")

    def __init__(self, dpo_cfg):
        self.opts = dpo_cfg
        self.reference = None
        self._tokens: tuple[int | None, tuple[int, ...]] | None = None
        self._cache: dict[str, dict[int, tuple[float, float]]] | None = None  # precompute_ref: split -> index -> ref

    # ---- building -------------------------------------------------------------------------------------------
    def build(self, ctx: RunContext, ds_config: dict):
        cfg = ctx.cfg
        lora = lora_settings(cfg.model)
        actor = build_actor(ctx.model_path, ds_config, attn_impl=cfg.model.attn_impl,
                            gradient_checkpointing=cfg.model.gradient_checkpointing, lora=lora,
                            quantize=cfg.model.quantize_base, kernels=cfg.model.kernels)
        if self.opts.reference:
            if lora:  # the base never changes under LoRA: it is the starting model, without a copy
                self.reference = build_shared_reference(actor)
            else:
                frozen = ctx.ds_config(role="reference", micro_batch_size=max(1, cfg.optim.micro_batch_size),
                                       lr=0.0, total_steps=1, frozen=True)
                self.reference = build_reference(ctx.model_path, frozen, attn_impl=cfg.model.attn_impl,
                                                 kernels=cfg.model.kernels)
        return actor

    def prepare(self, engine, ctx: RunContext, store, train_idx: list[int], eval_rows: list[dict]) -> None:
        """With `dpo.precompute_ref`: the reference's response log-probs of every training row (each rank computes
        all of them, so every rank runs the same forwards) and of this rank's evaluation rows, kept by store index;
        then a frozen reference copy is released."""
        if not (self.opts.precompute_ref and self.reference is not None):
            return
        cache: dict[str, dict[int, tuple[float, float]]] = {"train": {}, "eval": {}}
        chunk = 1024
        for lo in range(0, len(train_idx), chunk):
            self._fill(cache["train"], ctx, store.rows(train_idx[lo:lo + chunk]))
        self._fill(cache["eval"], ctx, eval_rows)
        self._cache = cache
        ctx.print(f"[dpo] dpo.precompute_ref: reference log-probs of {len(cache['train'])} training and "
                  f"{len(cache['eval'])} evaluation pairs computed; the reference does not run again")
        self.reference = None  # a frozen copy's memory is free from here on (a LoRA actor's view owns none)
        gc.collect()
        if ctx.dist.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fill(self, cache: dict, ctx: RunContext, rows: list[dict]) -> None:
        for group in self.micro_batches(ctx, rows):
            ref_c, ref_r = self._reference_logps(ctx, group or rows[:1])
            for r, c, j in zip(group, ref_c.tolist(), ref_r.tolist()):
                cache[int(r["index"])] = (c, j)

    # ---- the loss -------------------------------------------------------------------------------------------
    def chat_tokens(self, ctx: RunContext) -> tuple[int | None, tuple[int, ...]]:
        """The tokenizer's end-of-turn id and the chat template's tail after it, computed once."""
        if self._tokens is None:
            eot = end_of_turn_id(ctx.tokenizer)
            self._tokens = (eot, turn_tail_ids(ctx.tokenizer, eot) if eot is not None else ())
        return self._tokens

    def micro_batches(self, ctx: RunContext, rows: list[dict]) -> list[list[dict]]:
        lengths = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
        return token_budget_groups(ctx, rows, lengths, padded=False)

    def count(self, rows: list[dict]) -> float:
        return float(len(rows))

    def _reference_logps(self, ctx: RunContext, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        self.reference.eval()
        with torch.no_grad():
            sums, _ = response_logps(self.reference, pair_spans(rows, *self.chat_tokens(ctx)), ctx.dist.device)
        return sums[0::2], sums[1::2]

    def pair_terms(self, engine, ctx: RunContext, rows: list[dict], split: str) -> dict[str, torch.Tensor]:
        """Per pair: the loss, the implicit rewards, their margin and whether chosen wins (`preference_loss`)."""
        sums, counts = response_logps(engine, pair_spans(rows, *self.chat_tokens(ctx)), ctx.dist.device)
        ref_c = ref_r = None
        if self.opts.reference:
            if self._cache is not None:
                ref = torch.tensor([self._cache[split][int(r["index"])] for r in rows], dtype=sums.dtype,
                                   device=sums.device)
                ref_c, ref_r = ref[:, 0], ref[:, 1]
            else:
                ref_c, ref_r = self._reference_logps(ctx, rows)
        ratio_c, ratio_r = log_ratios(sums[0::2], sums[1::2], ref_c, ref_r, counts[0::2], counts[1::2],
                                      length_norm=self.opts.length_norm)
        return preference_loss(self.opts.loss, ratio_c, ratio_r, beta=self.opts.beta,
                               label_smoothing=self.opts.label_smoothing, margin=self.opts.margin)

    def loss_terms(self, engine, ctx: RunContext, rows: list[dict]):
        t = self.pair_terms(engine, ctx, rows, "train")
        return t["loss"].sum(), {"dpo/loss": t["loss"].mean().detach(), "rewards/chosen": t["chosen"].mean(),
                                 "rewards/rejected": t["rejected"].mean(), "rewards/margin": t["margin"].mean(),
                                 "rewards/accuracy": t["correct"].mean()}

    def evaluate(self, engine, ctx: RunContext, rows: list[dict]) -> dict:
        totals = dict.fromkeys(("loss", "chosen", "rejected", "margin", "correct"), 0.0)
        n = 0
        for group in self.micro_batches(ctx, rows):
            t = self.pair_terms(engine, ctx, group or rows[:1], "eval")
            if not group:
                continue
            for k in totals:
                totals[k] += float(t[k].sum())
            n += len(group)
        n = max(n, 1)
        return {"eval/loss": totals["loss"] / n, "eval/rewards/chosen": totals["chosen"] / n,
                "eval/rewards/rejected": totals["rejected"] / n, "eval/rewards/margin": totals["margin"] / n,
                "eval/rewards/accuracy": totals["correct"] / n}

    def export(self, engine, ctx: RunContext, out_dir: Path) -> None:
        export_hf(engine, ctx.tokenizer, out_dir)
