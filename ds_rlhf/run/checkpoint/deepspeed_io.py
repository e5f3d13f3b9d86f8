"""A DeepSpeed engine's state in a run checkpoint: `save_checkpoint` / `load_checkpoint` (module, optimizer incl.
ZeRO partitions, scheduler, client state).

``save_checkpoint`` = ``engine.save_checkpoint`` + the resolved ds_config beside it + one file per rank with 1-bit
Adam's error-feedback buffers (DeepSpeed saves the stage-0 optimizer from rank 0 only, but those buffers differ per
rank). A LoRA model's frozen base is left out (``excludable_frozen``) and rebuilt from ``model.path`` on resume. Frozen
roles are not checkpointed: they are rebuilt from their source path. Every file loads weights-only
(``engines/weights_only.py``: nothing a checkpoint holds is run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ds_rlhf.distributed import barrier, world
from ds_rlhf.engines.ds_config import save_resolved_config
from ds_rlhf.engines.onebit_adam import find_onebit
from ds_rlhf.engines.roles import role_info
from ds_rlhf.engines.weights_only import load_torch_file, weights_only_loads

# DeepSpeed returns its own bookkeeping keys in the client state too; ours live under one key.
CLIENT_KEY = "ds_rlhf_client_state"


def _onebit_file(path: Path, rank: int) -> Path:
    return path / f"onebit_errors_rank{rank}.pt"


def save_checkpoint(engine, ckpt_dir: str | os.PathLike, tag: str, client_state: dict | None = None) -> Path:
    """Save ``engine`` under ``ckpt_dir/tag`` (collective: call on every rank). Returns that directory."""
    info = role_info(engine)
    if info is not None and not info.trainable:
        raise ValueError(f"{info.role} engine is frozen; it is rebuilt from its source checkpoint, so there is "
                         "nothing to save")
    ckpt_dir = Path(ckpt_dir)
    frozen = excludable_frozen(engine)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={CLIENT_KEY: dict(client_state or {})},
                           **({"exclude_frozen_parameters": True} if frozen else {}))
    path = ckpt_dir / tag
    if world()[0] == 0:
        if info is not None:
            save_resolved_config(info.ds_config, path)
        if frozen:
            (path / FROZEN_FILE).write_text(json.dumps({"excluded": frozen}) + "\n")
    onebit = find_onebit(engine)
    if onebit is not None:
        torch.save({"errors": onebit.error_state_dict()}, _onebit_file(path, world()[0]))
    barrier()
    return path


FROZEN_FILE = "frozen_excluded.json"


def excludable_frozen(engine) -> list[str]:
    """The frozen parameters a checkpoint of this trainable engine leaves out: a LoRA model's (or the shared-base
    critic's) base, which never changes and is rebuilt from `model.path` on resume, so a checkpoint holds what
    trains (an 8B LoRA actor: its adapters and their optimizer states, not 16 GB of base weights). None at ZeRO-3
    (DeepSpeed saves and restores partitioned parameters apart from the module's state dict) or with a quantized
    base (bitsandbytes keeps each weight's quantization state beside it in the state dict)."""
    module = getattr(engine, "module", engine)
    if not isinstance(module, torch.nn.Module):
        return []
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    params = list(module.named_parameters())
    frozen = [n for n, p in params if not p.requires_grad]
    if stage == 3 or not frozen or len(frozen) == len(params) or any(
            p.dtype in (torch.uint8, torch.int8) for _, p in params):
        return []
    return frozen


def excluded_frozen(tag_dir: Path) -> set[str]:
    """The frozen parameters the checkpoint at `tag_dir` left out (`excludable_frozen`; empty for one that holds
    every weight): on resume and export they come from the base model."""
    path = tag_dir / FROZEN_FILE
    return set(json.loads(path.read_text())["excluded"]) if path.is_file() else set()


def _trained_weights_loader(excluded: set[str]):
    """DeepSpeed's `custom_load_fn` for a checkpoint without its frozen parameters: every other tensor must be
    there (a missing trained weight would silently keep its initial value), and the frozen ones stay as built."""

    def load(src: dict, dst: torch.nn.Module) -> None:
        result = dst.load_state_dict(src, strict=False)
        missing = sorted(set(result.missing_keys) - excluded)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint weights do not match the model: missing {missing[:5]}, unexpected "
                               f"{sorted(result.unexpected_keys)[:5]}")

    return load


def load_checkpoint(engine, ckpt_dir: str | os.PathLike, tag: str) -> dict:
    """Restore module, optimizer, scheduler (and 1-bit error buffers) into ``engine``; return the client state."""
    if not (Path(ckpt_dir) / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint with tag {tag!r} under {ckpt_dir}")
    excluded = excluded_frozen(Path(ckpt_dir) / tag)
    loader = {"custom_load_fn": _trained_weights_loader(excluded)} if excluded else {}
    with weights_only_loads():
        load_path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True, **loader)
    if load_path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint with tag {tag!r} under {ckpt_dir}")
    onebit = find_onebit(engine)
    if onebit is not None:
        path = _onebit_file(Path(ckpt_dir) / tag, world()[0])
        if path.exists():
            onebit.load_error_state_dict(load_torch_file(path)["errors"])
        elif onebit.compressing:
            raise FileNotFoundError(f"{path} is missing: 1-bit Adam is past warm-up and needs this rank's error "
                                    "buffers to resume exactly (was the checkpoint saved with a different world size?)")
    return (client_state or {}).get(CLIENT_KEY, {})
