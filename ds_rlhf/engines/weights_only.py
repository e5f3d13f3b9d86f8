"""Loading checkpoint files without running them.

Nothing a checkpoint holds is run: every checkpoint file loads with ``torch.load(weights_only=True)``. DeepSpeed 0.19
calls ``torch.load(weights_only=False)`` for its engine files (model states, ZeRO optimizer partitions) from
``engine.load_checkpoint`` and ``deepspeed.utils.zero_to_fp32``; inside ``weights_only_loads()`` every ``torch.load``
is made a weights-only load that also accepts the few DeepSpeed types those files hold (``DEEPSPEED_TYPES``: the ZeRO
stage enum, the fragment addresses of ZeRO-1/2 and bf16 optimizers, the fp16 loss scalers). Any other pickled global
(a function, a class) is refused before it is called: ``CheckpointRefused``, one line naming the file and the global.
A matching sha256 manifest (``ds_rlhf.run.checkpoint.manager``) shows a file is the one that was saved, not who
saved it, so the checks are independent.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import threading
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# The globals DeepSpeed 0.19's ZeRO 0-3 checkpoints pickle besides tensors and plain Python values (found by saving
# real checkpoints of every stage, bf16 and offload included, and listing torch.serialization's
# get_unsafe_globals_in_checkpoint; the loss scalers are the fp16 optimizers' state).
DEEPSPEED_TYPES = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
                   "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
_GLOBAL = re.compile(r"GLOBAL (\S+)")


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint file holds a pickled global outside the allow-list: it was not loaded (nothing in it ran)."""


def _allowed_types() -> list:
    out = []
    for name in DEEPSPEED_TYPES:
        module, _, attr = name.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def refusal(path, exc: Exception) -> CheckpointRefused:
    """torch's weights-only UnpicklingError for ``path`` as one line naming the file and the global it refused."""
    text = str(exc)
    found = _GLOBAL.search(text)
    if found:
        what = f"the pickled global {found.group(1).rstrip('.,')}"
    else:
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        what = f"pickled data a weights-only load refuses ({detail[0] if detail else type(exc).__name__})"
    return _refused(path, what)


def _refused(path, what: str) -> CheckpointRefused:
    name = os.fspath(path) if isinstance(path, str | os.PathLike) else getattr(path, "name", repr(path))
    return CheckpointRefused(f"{name} holds {what}, which is not a tensor, a plain value or one of the DeepSpeed "
                             "types checkpoints hold: refused without running it (was the checkpoint written by "
                             "another program, or altered?)")


def scan_torch_file(path: Path, allowed: Iterable[str] = ()) -> None:
    """Raise ``CheckpointRefused`` when the torch zip archive at ``path`` pickles a global outside DEEPSPEED_TYPES and
    ``allowed`` (names as ``module.qualname``). Only the pickle's opcodes are read (nothing is loaded or run), so a
    checkpoint is refused before any model loads. Other files, and archives too damaged to read, are left to the
    load, which reports them."""
    if not zipfile.is_zipfile(path):
        return
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a damaged archive: the load names the file and the problem
        return
    bad = [name for name in found if name not in DEEPSPEED_TYPES and name not in set(allowed)]
    if bad:
        raise _refused(path, f"the pickled global {bad[0]}")


def load_torch_file(path, map_location="cpu", extra_types=(), **kwargs):
    """``torch.load(path, weights_only=True)`` accepting the DeepSpeed types (and ``extra_types``); a file holding any
    other global raises ``CheckpointRefused`` (its message names the file and the global)."""
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)
    with torch.serialization.safe_globals([*_allowed_types(), *extra_types]):
        try:
            return _torch_load(path, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            if isinstance(exc, CheckpointRefused):
                raise
            raise refusal(path, exc) from None


_torch_load = torch.load
_patch_lock = threading.Lock()
_patch_depth = 0


def _weights_only_load(f, map_location=None, pickle_module=None, **kwargs):
    return load_torch_file(f, map_location, **kwargs)


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block, every ``torch.load`` in the process (DeepSpeed's ``load_checkpoint`` and ``zero_to_fp32``
    ask for ``weights_only=False``) is ``load_torch_file``: weights only, the DeepSpeed types allowed."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            torch.load = _weights_only_load
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.load = _torch_load
