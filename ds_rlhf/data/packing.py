"""Batch shaping for training: length-grouped order, token-budget micro-batches, padding-free packing.

Why: RLHF sequences vary from tens to thousands of tokens. Padding a micro-batch to its longest member wastes
compute, and a fixed micro-batch size either wastes memory on short batches or runs out of it on long ones. So:

* `length_grouped_order` makes consecutive groups hold similar lengths (less padding), still shuffled per seed;
* `token_budget_microbatches` ("dynamic batch size") splits a batch into micro-batches of at most `max_tokens`
  tokens (never splitting a sequence; an over-budget sequence gets a micro-batch of its own);
* `pack_sequences` concatenates a micro-batch into one row with `cu_seqlens` / `position_ids`, the layout
  flash-attention's varlen kernels and HF's padding-free path (position_ids restarting at 0) understand;
  `packed_attention_mask` gives SDPA/eager attention the equivalent block-diagonal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def _as_long(seq) -> torch.Tensor:
    import torch

    if isinstance(seq, torch.Tensor):
        return seq.reshape(-1).long()
    return torch.as_tensor(np.asarray(seq, dtype=np.int64).reshape(-1))


def pack_sequences(seqs: Sequence, *, extras: dict[str, Sequence] | None = None) -> dict:
    """Concatenate sequences into one padding-free row.

    Returns input_ids [1, N] (int64), position_ids [1, N] (restarting at 0 per sequence), cu_seqlens [n+1] (int32,
    cumulative lengths starting at 0), max_seqlen (int), seq_lens (list[int]), plus every `extras` entry (e.g.
    loss_mask, per-token advantages) packed the same way as [1, N] (dtype kept when given as tensors).
    """
    import torch

    if len(seqs) == 0:
        raise ValueError("pack_sequences needs at least one sequence")
    parts = [_as_long(s) for s in seqs]
    lens = [int(p.numel()) for p in parts]
    if min(lens) == 0:
        raise ValueError(f"cannot pack an empty sequence (index {lens.index(0)})")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    out = {
        "input_ids": torch.cat(parts).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).unsqueeze(0),
        "cu_seqlens": cu,
        "max_seqlen": max(lens),
        "seq_lens": lens,
    }
    for name, values in (extras or {}).items():
        if len(values) != len(seqs):
            raise ValueError(f"extras[{name!r}] has {len(values)} sequences, expected {len(seqs)}")
        tensors = [v.reshape(-1) if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v).reshape(-1))
                   for v in values]
        for i, (t, n) in enumerate(zip(tensors, lens)):
            if t.numel() != n:
                raise ValueError(f"extras[{name!r}][{i}] has {t.numel()} values for a {n}-token sequence")
        out[name] = torch.cat(tensors).unsqueeze(0)
    return out


def unpack_sequences(packed: torch.Tensor, cu_seqlens) -> list[torch.Tensor]:
    """Split a packed [1, N, ...] or [N, ...] tensor (e.g. per-token log-probs) back into per-sequence tensors."""
    flat = packed[0] if packed.dim() >= 2 and packed.shape[0] == 1 else packed
    cu = [int(x) for x in cu_seqlens]
    if cu[-1] != flat.shape[0]:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed tensor has {flat.shape[0]} tokens")
    return [flat[a:b] for a, b in zip(cu[:-1], cu[1:])]


def packed_attention_mask(cu_seqlens, dtype=None) -> torch.Tensor:
    """Additive [1, 1, N, N] block-diagonal causal mask for a packed row (0 = attend, dtype min = blocked).

    flash-attention's varlen kernels take `cu_seqlens` directly; SDPA and eager attention (CPU, or GPUs without
    flash-attn) need this explicit mask so packed sequences cannot attend to each other.
    """
    import torch

    dtype = dtype or torch.float32
    lens = torch.diff(torch.as_tensor([int(x) for x in cu_seqlens], dtype=torch.int64))
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    n = int(lens.sum())
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def token_budget_microbatches(lengths, max_tokens: int, *, padded: bool = False, sort: bool = True,
                              min_microbatches: int = 1) -> list[list[int]]:
    """Group indices into micro-batches costing at most `max_tokens` each; every index appears exactly once.

    Cost is the sum of lengths (padding-free packing) or, with `padded`, count x longest (a padded batch).
    `sort` packs longest-first (first-fit decreasing: fewer, fuller micro-batches); `sort=False` keeps the given
    order (greedy). `min_microbatches` splits the largest groups until there are at least that many, so data-
    parallel ranks can agree on a common count (all-reduce the max, then call again); if there are fewer
    sequences than that, empty micro-batches pad the list. Indices inside a micro-batch are in ascending order.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = np.argsort(-lens, kind="stable") if sort else np.arange(len(lens))
    bins: list[list[int]] = []
    if padded or not sort:
        cur: list[int] = []
        longest = total = 0
        for i in order.tolist():
            n = int(lens[i])
            cost = max(longest, n) * (len(cur) + 1) if padded else total + n
            if cur and cost > max_tokens:
                bins.append(cur)
                cur, longest, total = [], 0, 0
            cur.append(i)
            longest, total = max(longest, n), total + n
        if cur:
            bins.append(cur)
    else:
        loads: list[int] = []
        for i in order.tolist():
            n = int(lens[i])
            for b, load in enumerate(loads):
                if load + n <= max_tokens:
                    bins[b].append(i)
                    loads[b] += n
                    break
            else:
                bins.append([i])
                loads.append(n)
    while len(bins) < min_microbatches:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins += [[] for _ in range(min_microbatches - len(bins))]
            break
        b = max(splittable, key=lambda k: (int(lens[bins[k]].sum()), len(bins[k])))
        group = bins.pop(b)
        half = len(group) // 2
        bins += [group[:half], group[half:]]
    return [sorted(b) for b in bins]


def length_grouped_order(lengths, group_size: int, seed, *, megabatch_groups: int = 16,
                         longest_first: bool = True) -> np.ndarray:
    """A shuffled permutation in which each consecutive `group_size` chunk holds similar lengths.

    Rows are shuffled, cut into mega-batches of `megabatch_groups` groups, sorted by length inside each
    mega-batch, cut into groups, and the groups shuffled. `seed` may be an int or a tuple (e.g. (seed, epoch)).
    With `longest_first` the group holding the longest row comes first, so an out-of-memory shows up at step 1.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    rng = np.random.default_rng(np.random.SeedSequence(list(np.atleast_1d(seed).tolist())))
    perm = rng.permutation(len(lens))
    mega = group_size * max(1, megabatch_groups)
    chunks = [perm[i:i + mega] for i in range(0, len(perm), mega)]
    ordered = np.concatenate([c[np.argsort(-lens[c], kind="stable")] for c in chunks]) if chunks else perm
    groups = [ordered[i:i + group_size] for i in range(0, len(ordered), group_size)]
    # keep a trailing partial group last, so full groups stay aligned to group_size boundaries
    tail = groups.pop() if groups and len(groups[-1]) < group_size else None
    order = rng.permutation(len(groups))
    groups = [groups[k] for k in order]
    if longest_first and groups:
        top = max(range(len(groups)), key=lambda k: int(lens[groups[k]].max()))
        groups.insert(0, groups.pop(top))
    if tail is not None:
        groups.append(tail)
    return np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)


def microbatch_rows(rows: list[dict], max_tokens: int, *, key: str = "input_ids",
                    extras: Sequence[str] = ("loss_mask",), min_microbatches: int = 1) -> list[dict]:
    """Loader batch -> packed micro-batches within a token budget; each dict also has "indices" into `rows`."""
    lengths = [len(r[key]) for r in rows]
    out = []
    for mb in token_budget_microbatches(lengths, max_tokens, min_microbatches=min_microbatches):
        if not mb:
            continue
        packed = pack_sequences([rows[i][key] for i in mb],
                                extras={e: [rows[i][e] for i in mb] for e in extras if e in rows[mb[0]]})
        packed["indices"] = mb
        out.append(packed)
    return out
