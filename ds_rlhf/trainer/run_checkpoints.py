"""Crash-safe run checkpoints: DeepSpeed engine states + trainer state, published by an atomic rename.

Layout: `<run>/checkpoints/step_00000012/{actor,critic,...}/` (DeepSpeed's own format), `trainer_state.pt`
(step, data-loader position, KL controller, ...), `rng_rank<r>.pt`, and a `COMPLETE` marker. Everything is written
into `.tmp_step_*` first; only a finished directory is renamed into place, so a `kill -9` at any moment leaves the
previous checkpoint intact and at worst a temp dir that the next save or resume deletes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ds_rlhf.distributed import barrier

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, rank: int = 0, keep_last: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.keep_last = keep_last

    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and (p / "COMPLETE").exists()]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def resolve(self, resume: str) -> Path | None:
        """`latest` -> newest complete checkpoint (None if there is none); a path -> that checkpoint."""
        if not resume:
            return None
        if resume == "latest":
            return self.latest()
        path = Path(resume)
        if not (path / "COMPLETE").exists():
            raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint directory (no COMPLETE marker)")
        return path

    def save(self, step: int, engines: dict, trainer_state: dict) -> Path:
        """Save on every rank (DeepSpeed writes per-rank shards); rank 0 publishes the directory."""
        from ds_rlhf.engines.engine_io import save_checkpoint

        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp_step_{step:08d}"
        if self.rank == 0:
            self._remove_stale_temps()
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        for name, engine in engines.items():
            save_checkpoint(engine, tmp / name, tag="state", client_state={})
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        barrier()
        if self.rank == 0:
            torch.save({"step": step, **trainer_state}, tmp / "trainer_state.pt")
            (tmp / "COMPLETE").write_text(f"{step}\n")
            _fsync_dir(tmp)
            if final.exists():  # re-saving the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        barrier()
        return final

    def load(self, path: Path, engines: dict) -> dict:
        from ds_rlhf.engines.engine_io import load_checkpoint

        for name, engine in engines.items():
            load_checkpoint(engine, path / name, tag="state")
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if self.rank == 0:
            self._remove_stale_temps()
        return state

    def _remove_stale_temps(self) -> None:
        if self.root.is_dir():
            for p in self.root.glob(".tmp_step_*"):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        done = self.complete_checkpoints()
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
