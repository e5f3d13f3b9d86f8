"""Every RNG's state for run checkpoints (`rng_rank<r>.pt`), stored as tensors and plain Python values so that it
loads with `torch.load(weights_only=True)`; `load_rng_file` still reads the files of older checkpoints, which held
numpy's own state tuple. Used by `manager.py:CheckpointManager`.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from numpy._core.multiarray import _reconstruct

from ds_rlhf.engines.weights_only import load_torch_file


def rng_state() -> dict:
    """Every RNG's state as tensors and plain Python values (loadable with `torch.load(weights_only=True)`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(),  # (int, tuple of ints, float | None)
             "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuples(state["python"]))
    numpy = state["numpy"]
    if isinstance(numpy, dict):
        np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                             numpy["has_gauss"], numpy["cached_gaussian"]))
    else:  # older checkpoints: numpy's own tuple
        np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def load_rng_file(path: Path) -> dict:
    """This rank's RNG file, weights only; the files of older checkpoints held numpy's state tuple, so numpy's array
    types are allowed too (any other pickled global raises `weights_only.CheckpointRefused`)."""
    return load_torch_file(path, extra_types=(_reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType))


__all__ = ["load_rng_file", "rng_state", "set_rng_state"]
