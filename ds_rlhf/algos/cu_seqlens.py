"""Conversions between packed 1-D token streams (``cu_seqlens``) and padded ``[S, L]`` batches.

Packed layout: ``S`` sequences laid end to end in one 1-D tensor of ``N`` tokens; sequence ``i`` occupies
``x[cu_seqlens[i]:cu_seqlens[i + 1]]`` (the FlashAttention ``varlen`` convention, ``cu_seqlens[0] = 0``,
``cu_seqlens[-1] = N``). The estimators in this package are written once for the padded layout; the packed
entry points go through these two index maps, which are exact inverses on the valid tokens.
"""

from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Validate ``cu_seqlens`` (1-D, integer, starts at 0, non-decreasing, ends at ``num_tokens``); return int64."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a non-empty 1-D tensor, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point():
        raise TypeError("cu_seqlens must be an integer tensor")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at {num_tokens}, got {cu[0]}..{cu[-1]}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def _packed_index(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    lengths = cu[1:] - cu[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    cols = torch.arange(int(cu[-1]), device=cu.device) - cu[rows]
    max_len = int(lengths.max()) if lengths.numel() else 0
    return rows, cols, max_len


def packed_to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor,
                     pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter packed ``x[N, ...]`` into right-padded ``[S, L_max, ...]``; also return the bool mask ``[S, L_max]``."""
    cu = check_cu_seqlens(cu_seqlens.to(x.device), x.shape[0])
    rows, cols, max_len = _packed_index(cu)
    num_seqs = cu.numel() - 1
    padded = x.new_full((num_seqs, max_len, *x.shape[1:]), pad_value)
    padded[rows, cols] = x
    valid = torch.zeros(num_seqs, max_len, dtype=torch.bool, device=x.device)
    valid[rows, cols] = True
    return padded, valid


def padded_to_packed(padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Gather the valid prefix of each row of ``padded[S, L, ...]`` back into the packed ``[N, ...]`` layout."""
    cu = cu_seqlens.to(padded.device).long()
    rows, cols, _ = _packed_index(cu)
    return padded[rows, cols]
