"""Padding-free packing of right-padded RL micro-batches (`data.rl_packing`), and the way back.

A micro-batch of right-padded rows `[B, L]` (attention mask 1 on each row's valid prefix of n_i tokens) becomes
ONE row: the valid tokens laid end to end (`input_ids [1, N]`, N = sum of n_i), `position_ids [1, N]` restarting at
0 for each sequence, and no attention mask. Transformers turns the position restarts into a block-diagonal causal
mask (SDPA/eager) or `cu_seqlens` (flash / varlen attention), so sequences never attend to each other.

Per-position outputs of that row (log-probs, entropy, values) are indexed like `Trajectory`'s per-token tensors:
packed position j scores packed token j+1. Sequence i occupies packed positions [s_i, s_i + n_i); its positions
s_i .. s_i + n_i - 2 score its own tokens 1 .. n_i - 1 and map to the padded positions (i, 0 .. n_i - 2) of the
`[B, L-1]` layout the losses use. Its last position s_i + n_i - 1 would score the *next* sequence's first token:
it maps to no padded position, so a cross-sequence target is excluded by construction (not masked afterwards).
`PackedRows.unpack` is a gather (autograd flows back to the packed tensor); unscored padded positions read 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """One packed row made from right-padded rows, with the index map back to the padded `[B, L-1]` layout."""

    input_ids: torch.Tensor  # [1, N] long: the rows' valid tokens, end to end
    position_ids: torch.Tensor  # [1, N] long: 0 .. n_i - 1 for each sequence
    seq_lens: torch.Tensor  # [B] long: n_i, the valid tokens of each row
    gather_index: torch.Tensor  # [B, L-1] long: packed position scoring padded (i, t); N - 1 = unscored (reads 0)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [B+1] sequence boundaries in the packed row (the flash-attention varlen convention)."""
        cu = torch.zeros(self.seq_lens.numel() + 1, dtype=torch.int32, device=self.seq_lens.device)
        cu[1:] = torch.cumsum(self.seq_lens, 0)
        return cu

    @property
    def scored(self) -> torch.Tensor:
        """bool [B, L-1]: the padded positions that get a value from the packed row (t < n_i - 1)."""
        return self.gather_index < self.num_tokens - 1

    def packed_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """bool `[1, N-1]`: the packed positions that score a padded position set in `mask` (`[B, L-1]`)."""
        if mask.shape != self.gather_index.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != padded positions {tuple(self.gather_index.shape)}")
        out = torch.zeros(self.num_tokens, dtype=torch.bool, device=mask.device)
        out[self.gather_index[mask.bool() & self.scored]] = True
        return out[None, : self.num_tokens - 1]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-position values of the packed row, `[1, N-1]` (or `[1, N]`: the last position is never read), into
        the padded `[B, L-1]` layout; unscored positions (past a row's end, or none at all) are 0. Differentiable:
        an index into the packed values plus one appended zero, no in-place write."""
        if packed.dim() != 2 or packed.shape[0] != 1 or packed.shape[1] not in (self.num_tokens - 1, self.num_tokens):
            raise ValueError(f"expected packed values of shape [1, {self.num_tokens - 1}], got {tuple(packed.shape)}")
        flat = packed[0, : self.num_tokens - 1]
        return torch.cat([flat, flat.new_zeros(1)])[self.gather_index]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack right-padded rows `input_ids [B, L]` (valid where `attention_mask` is 1, a prefix of each row) into
    one padding-free row; see the module doc for the layout. Raises ValueError for rows that are not
    right-padded (a packed row has no way to express a gap)."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must both be [B, L]")
    batch, width = input_ids.shape
    lens = attention_mask.long().sum(1)
    valid = torch.arange(width, device=input_ids.device)[None, :] < lens[:, None]
    if not torch.equal(valid, attention_mask.bool()):
        raise ValueError("pack_rows needs right-padded rows: each row's attention_mask must be 1s then 0s")
    total = int(lens.sum())
    if total == 0:
        raise ValueError("pack_rows: the rows hold no tokens")
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    starts = torch.cumsum(lens, 0) - lens
    t = torch.arange(width - 1, device=input_ids.device)[None, :]
    own = t < (lens - 1)[:, None]  # position t scores token t+1 of the same row
    gather_index = torch.where(own, starts[:, None] + t, torch.full_like(t, total - 1))
    return PackedRows(input_ids=input_ids[valid].unsqueeze(0), position_ids=positions[valid].unsqueeze(0),
                      seq_lens=lens, gather_index=gather_index)
