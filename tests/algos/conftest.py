"""Shared inputs for the algos tests: ragged response masks of every shape the trainer can produce."""

from __future__ import annotations

import pytest
import torch


def _masks(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded, left-padded and gapped bool masks ``[batch, length]``; each has a full row and an empty row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = length, 0
    right = torch.arange(length) < lengths[:, None]
    gaps = torch.rand(batch, length, generator=gen) < 0.6
    gaps[0], gaps[-1] = True, False
    return {"right": right, "left": right.flip(-1), "gaps": gaps}


@pytest.fixture
def make_masks():
    return _masks

