"""The best checkpoint of an RL run by one eval metric: `BestCheckpointTracker` says whether an evaluation
(`rl_eval.evaluate`) is the best so far, `keep_best` keeps that step's checkpoint as `run_dir/checkpoints/best`.
The trainer (`recipes.rl.RLTrainer`) uses both; both stay importable from `rl_eval`."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

from ds_rlhf.atomic_files import publish_dir

BEST_DIR = "best"
BEST_INFO = "BEST.json"


class BestCheckpointTracker:
    """The best value of one eval metric so far and its step; `update` says whether a new eval is the best.

    Strictly better only (a tie keeps the earlier step); a missing or non-finite value is never the best.
    `state_dict()` holds plain Python values (for the trainer state, `torch.load(weights_only=True)`-safe).
    """

    def __init__(self, metric_key: str, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.metric_key, self.mode = metric_key, mode
        self.best_step: int | None = None
        self.best_value: float | None = None

    def is_better(self, value) -> bool:
        try:
            value = float(value)
        except (TypeError, ValueError):
            return False
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def update(self, step: int, metrics: dict) -> bool:
        """Record `metrics[metric_key]` at `step` if it is the best so far; True when it is."""
        value = metrics.get(self.metric_key)
        if not self.is_better(value):
            return False
        self.best_step, self.best_value = int(step), float(value)
        return True

    def state_dict(self) -> dict:
        return {"metric_key": self.metric_key, "mode": self.mode, "best_step": self.best_step,
                "best_value": self.best_value}

    def load_state_dict(self, state: dict) -> None:
        """Restore; a state recorded for another metric or mode is not comparable: dropped, with a warning."""
        if state.get("metric_key") != self.metric_key or state.get("mode") != self.mode:
            warnings.warn(f"best-checkpoint state is for {state.get('metric_key')!r} ({state.get('mode')}), this "
                          f"run tracks {self.metric_key!r} ({self.mode}): starting the best over", stacklevel=2)
            self.best_step = self.best_value = None
            return
        step, value = state.get("best_step"), state.get("best_value")
        self.best_step = None if step is None else int(step)
        self.best_value = None if value is None else float(value)


def _link_or_copy(src: str, dst: str) -> str:
    """Hard-link (checkpoint files are never rewritten in place: a re-save renames a new directory in); copy where
    links are impossible (another filesystem, no link support)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def keep_best(run_dir: str | os.PathLike, step_dir: str | os.PathLike, info: dict | None = None) -> Path:
    """Make `run_dir/checkpoints/best` a copy (hard links where possible) of the complete checkpoint `step_dir`,
    replacing the previous best; returns its path. Rank 0 only; outside `keep_last` rotation (not a step_* name).

    Built in `checkpoints/.tmp_best_<pid>` and renamed into place (`atomic_files.publish_dir`), so `best` is always a
    whole checkpoint: the old one or the new one. `info` (e.g. step, metric, value) is written to `best/BEST.json`.
    The `COMPLETE` manifest comes along, so `--run.resume <run>/checkpoints/best` verifies it like any checkpoint.
    """
    step_dir = Path(step_dir)
    best = Path(run_dir) / "checkpoints" / BEST_DIR
    if not (step_dir / "COMPLETE").is_file():
        raise ValueError(f"{step_dir} is not a complete checkpoint (no COMPLETE marker): nothing to keep as best")
    if best.exists() and step_dir.resolve() == best.resolve():
        return best

    def write(tmp: Path) -> None:
        shutil.copytree(step_dir, tmp, copy_function=_link_or_copy, symlinks=True, dirs_exist_ok=True)
        if info is not None:
            (tmp / BEST_INFO).write_text(json.dumps({"source": step_dir.name, **info}, sort_keys=True) + "\n")

    publish_dir(best, write)  # built in checkpoints/.tmp_best_<pid>, stale ones removed, swapped in whole
    return best
