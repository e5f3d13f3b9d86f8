"""Reward shaping and sample selection of the DAPO recipe (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476), as pure functions on tensors.

- ``overlong_penalty``: the soft overlong punishment (eq. 13), a length-dependent term added to the reward.
- ``group_spread`` / ``informative_groups``: dynamic sampling's test (eq. 11's constraint
  ``0 < |{o_i correct}| < G``, generalised to any reward): a prompt whose samples all got the same reward gives
  every sample a zero group-relative advantage, so it carries no gradient and only dilutes the batch.
- ``truncated_rows``: overlong filtering (sec. 3.3): which samples hit the generation budget, so their loss can be
  masked out.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), times ``factor``, for response lengths ``lengths[B]``:

        R(y) = 0                                 for |y| <= L_max - L_cache
        R(y) = ((L_max - L_cache) - |y|) / L_cache   for L_max - L_cache < |y| <= L_max
        R(y) = -1                                for |y| > L_max

    with ``L_max = max_len`` (the generation budget) and ``L_cache = buffer``. ``buffer`` 0 means no penalty.
    Returns float32 ``[B]`` (<= 0), to be added to the sequence reward.
    """
    if buffer < 0 or max_len < 1 or buffer > max_len:
        raise ValueError(f"need 0 <= buffer <= max_len and max_len >= 1 (got buffer={buffer}, max_len={max_len})")
    lengths = lengths.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    penalty = ((start - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return penalty * float(factor)


def group_spread(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max - min, count)`` of ``scores[B]`` per group ``0 .. num_groups-1`` (``group_ids[B]`` in that range).
    A group without samples has spread 0 and count 0."""
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(f"scores and group_ids must be 1-D of one shape, got {tuple(scores.shape)} and "
                         f"{tuple(group_ids.shape)}")
    x = scores.to(torch.float64)
    ids = group_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_groups):
        raise ValueError(f"group_ids must lie in [0, {num_groups})")
    high = torch.full((num_groups,), float("-inf"), dtype=x.dtype).scatter_reduce(0, ids, x, "amax")
    low = torch.full((num_groups,), float("inf"), dtype=x.dtype).scatter_reduce(0, ids, x, "amin")
    count = torch.zeros(num_groups, dtype=torch.long).index_add_(0, ids, torch.ones_like(ids))
    spread = torch.where(count > 0, high - low, torch.zeros_like(high))
    return spread, count


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                       tol: float = 1e-6) -> torch.Tensor:
    """Bool ``[num_groups]``: the group has at least two samples whose scores differ by more than ``tol``
    (DAPO's dynamic sampling keeps exactly these; the others have zero advantage for every sample)."""
    spread, count = group_spread(scores, group_ids, num_groups)
    return (count >= 2) & (spread > tol)


def truncated_rows(finish_reasons: list[str]) -> torch.Tensor:
    """Bool ``[B]``: the sample stopped at the generation budget (``finish_reason == "length"``), not at a stop
    token (DAPO's overlong filtering masks these samples' loss)."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
