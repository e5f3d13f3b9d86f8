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
