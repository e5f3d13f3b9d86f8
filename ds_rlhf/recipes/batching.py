"""Batching helpers shared by SFT, RM and RL: right-padding token lists, and micro-batch splits that run the same
number of micro-batches on every rank (ZeRO's collectives need that)."""

from __future__ import annotations

import torch

from ds_rlhf.data.packing import token_budget_microbatches
from ds_rlhf.distributed import agree_max
from ds_rlhf.engines.rm_scoring import ScoreRule, score_ids


def pad_right(seqs: list[list[int]], pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask) for token-id sequences. The mask comes from the lengths, never
    from comparing ids with `pad_id` (a sequence's final EOS stays attended where pad equals EOS): RM training
    pairs and reward-model scoring of rollouts read their score at the last attended token."""
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, x in enumerate(seqs):
        ids[row, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
        attn[row, : len(x)] = 1
    return ids.to(device), attn.to(device)


def pad_scored(seqs: list[list[int]], rule: ScoreRule, pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """`pad_right` of sequences a reward model scores, each first ended at its score token (`rm_scoring.score_ids`),
    so the last attended token is the one the score is read at: RM training and evaluation pairs and RL rollouts."""
    return pad_right([score_ids(x, rule) for x in seqs], pad_id, device)


def split_micro(lengths: list[int], *, max_tokens: int, max_rows: int, padded: bool = False,
                device=None) -> list[list[int]]:
    """Index groups: by token budget when `max_tokens` > 0, else `max_rows` each; the same count on every rank
    (see `agree_max`), so a rank with less data gets smaller or empty micro-batches rather than fewer."""
    n = len(lengths)
    if max_tokens > 0:
        groups = token_budget_microbatches(lengths, max_tokens, padded=padded) if n else []
    else:
        groups = [list(range(i, min(i + max_rows, n))) for i in range(0, n, max_rows)]
    count = agree_max(len(groups), device or "cpu")
    if count > len(groups):
        if max_tokens > 0 and n:
            groups = token_budget_microbatches(lengths, max_tokens, padded=padded, min_microbatches=count)
        else:
            per = -(-n // count) if n else 0
            groups = [list(range(i * per, min((i + 1) * per, n))) for i in range(count)]
    return groups
