"""Where a run's DeepSpeed config file is and what it holds: a path as given, or a config shipped with the package
(`ds_rlhf/ds_configs`). Reading only; `engines/ds_config.py` resolves its values for a run."""

from __future__ import annotations

import copy
import json
import os
from importlib import resources
from pathlib import Path


def packaged_ds_configs() -> Path:
    """The directory of the configs shipped with the package (``ds_rlhf/ds_configs``; the checkout's top-level
    ``ds_configs`` is a link to it)."""
    return Path(str(resources.files("ds_rlhf") / "ds_configs"))


def find_ds_config(path: str | os.PathLike) -> Path:
    """The DeepSpeed config file ``path`` names: the path as given (relative to the current directory), else the
    packaged config of that name, so ``ds_configs/zero2.json``, ``zero2.json`` and ``zero2`` work from any directory
    and from an installed wheel. A missing suffix means ``.json``."""
    given = Path(path)
    candidates = [given] if given.suffix else [given, given.with_suffix(".json")]
    if not given.is_absolute() and (len(given.parts) == 1 or given.parts[0] == "ds_configs"):
        packaged = packaged_ds_configs()
        candidates += [packaged.joinpath(*c.parts[1:] if c.parts[0] == "ds_configs" else c.parts) for c in candidates]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = sorted(p.stem for p in packaged_ds_configs().glob("*.json"))
    raise FileNotFoundError(f"DeepSpeed config not found: {path} (not a file here, nor a packaged config: "
                            f"{', '.join(names)})")


def load_ds_config(path_or_dict: str | os.PathLike | dict) -> dict:
    """A deep copy of a config dict, or the parsed JSON file (found by `find_ds_config`)."""
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    return json.loads(find_ds_config(path_or_dict).read_text())


# The run's settings that a DeepSpeed config file may also hold: setting -> the file's keys (dotted paths) that hold
# it. `gradient_accumulation_steps` and `train_batch_size` follow from several settings (`config_precedence.py`).
FILE_KEYS: dict[str, tuple[str, ...]] = {
    "optim.lr": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "optim.critic_lr": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "optim.weight_decay": ("optimizer.params.weight_decay",),
    "optim.betas": ("optimizer.params.betas",),
    "optim.eps": ("optimizer.params.eps",),
    "optim.warmup_steps": ("scheduler.params.warmup_num_steps",),
    "optim.grad_clip": ("gradient_clipping",),
    "optim.micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "model.dtype": ("bf16.enabled", "fp16.enabled"),
}
AUTO = "auto"


def file_value(raw: dict, dotted: str):
    """The explicit value at `dotted` in a DeepSpeed config dict; None when absent or "auto"."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if node == AUTO else node


def same_value(ours, theirs) -> bool:
    """Whether a setting's value and a file's value say the same (a tuple matches a list; numbers by value)."""
    if isinstance(ours, tuple | list) and isinstance(theirs, tuple | list):
        return len(ours) == len(theirs) and all(same_value(a, b) for a, b in zip(ours, theirs))
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return ours is theirs or ours == theirs
    if isinstance(ours, int | float) and isinstance(theirs, int | float):
        return abs(ours - theirs) <= 1e-12 * max(abs(ours), abs(theirs), 1.0)
    return ours == theirs
