"""Crash-safe run checkpoints: DeepSpeed engine states + trainer state, verified, published by an atomic rename.

Layout: `<run>/checkpoints/step_00000012/{actor,critic,...}/` (DeepSpeed's own format), `trainer_state.pt`
(step, data-loader position, KL controller, ...), `rng_rank<r>.pt`, and a `COMPLETE` marker. Everything is written
into `.tmp_step_*` first; only a finished directory is renamed into place, so a `kill -9` at any moment leaves the
previous checkpoint intact and at worst a temp dir that the next save or resume deletes.

Nothing lost, nothing silent:

- `COMPLETE` is JSON with the size and sha256 of every file of the checkpoint (files are fsynced while hashed).
  Resuming checks them before anything is loaded; a corrupt checkpoint is reported naming the file, and with
  `resume_fallback=True` the newest checkpoint that verifies is used instead (saying which were skipped and why).
  A marker of the older format (just the step number) reads as "unverified": a warning, and only a check for
  empty or truncated files.
- A save first checks the free space (the previous checkpoint's size, else an estimate from the engines'
  parameters); when it is short, or the disk fills during the save, it raises `CheckpointSpaceError` (an OSError
  with errno ENOSPC) naming the path and the bytes needed, with the partial directory removed and the previous
  checkpoint untouched. `check_room` asks the same at start, once the engines are built, so a run that could not
  save its first checkpoint stops before it trains. A save cut off by the file-size limit (`ulimit -f`) is
  `CheckpointSaveError`, one line naming the limit.
- `keep_last`: that many newest checkpoints are kept, 0 keeps all; the checkpoint just saved is never pruned.
- Every file loads with `torch.load(weights_only=True)` (`engines/weights_only.py:weights_only_loads`, DeepSpeed's
  engine files included, with the few DeepSpeed types they hold allowed): a file that pickles anything else is
  refused before it runs, naming the file and the global. RNG states are stored as tensors and plain values.

The engines' DeepSpeed states are `deepspeed_io.py`'s, the RNG state `rng.py`'s; listing, hashing, structural
checks and the size estimate of the checkpoint's files are `files.py`'s; the atomic rename is
`atomic_files.replace_dir`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch

from ds_rlhf.atomic_files import fsync_dir, replace_dir
from ds_rlhf.distributed import barrier
from ds_rlhf.engines.weights_only import CheckpointRefused, load_torch_file
from ds_rlhf.run.checkpoint.deepspeed_io import load_checkpoint, save_checkpoint
from ds_rlhf.run.checkpoint.files import (
    MARKER,
    engine_bytes,
    fmt_bytes,
    hash_tree,
    hit_size_limit,
    list_files,
    refused_global,
    structural_problem,
    tree_size,
)
from ds_rlhf.run.checkpoint.rng import load_rng_file, rng_state, set_rng_state
from ds_rlhf.run.run_dir import (
    STEP_DIR,
    RunDirError,
    broadcast_from_main,
    check_resume_path,
    complete_checkpoints,
    step_of,
)

MARKER_FORMAT = 2
_MARGIN = 1.1  # free space asked for beyond the estimate


class CheckpointCorrupt(RunDirError):
    pass


class CheckpointLoadError(RunDirError):
    pass


class CheckpointSaveError(RunDirError):
    """A save failed for a reason of the machine the user can change (the file-size limit)."""


class CheckpointSpaceError(RunDirError, OSError):
    """No room for a checkpoint: ``errno`` is ENOSPC, the message names the path and the bytes needed."""

    def __init__(self, message: str):
        OSError.__init__(self, errno.ENOSPC, message)

    def __str__(self) -> str:
        return f"[Errno {errno.ENOSPC}] {self.strerror}"


# ---- the manager ------------------------------------------------------------------------------------------------
class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, rank: int = 0, keep_last: int = 2, resume_fallback: bool = False,
                 log=None):
        keep_last = int(keep_last)
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last}: use a number >= 1 of checkpoints to keep, or 0 to keep all")
        self.root = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.keep_last = keep_last
        self.resume_fallback = resume_fallback
        self._log = log
        self._verified: set[Path] = set()

    def log(self, text: str) -> None:
        if self.rank != 0:
            return
        if self._log is not None:
            self._log(text)
        else:
            print(text, flush=True)

    def complete_checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    # ---- resume -----------------------------------------------------------------------------------------
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from, verified: `""` -> None; `latest` -> the newest complete checkpoint (None,
        said aloud, when there is none); a path -> that checkpoint. A corrupt one raises `CheckpointCorrupt`, or
        with `resume_fallback` gives way to the newest older one that verifies."""
        if not resume:
            return None
        if resume == "latest":
            candidates = self.complete_checkpoints()[::-1]
            if not candidates:
                self.log(f"[checkpoint] no checkpoint in {self.root}: starting fresh")
                return None
        else:
            path = check_resume_path(resume)
            siblings = complete_checkpoints(path.parent) if STEP_DIR.match(path.name) else []
            candidates = [path] + [p for p in siblings[::-1] if step_of(p) < step_of(path)]
        return self._first_valid(candidates)

    def _first_valid(self, candidates: list[Path]) -> Path:
        outcome = None
        if self.rank == 0:
            skipped = []
            for path in candidates if self.resume_fallback else candidates[:1]:
                problem = self.verify(path)
                if problem is None:
                    refused = refused_global(path)  # before any model loads, not when DeepSpeed reads the file
                    outcome = ("ok", str(path), skipped) if refused is None else ("refused", refused, skipped)
                    break
                skipped.append((str(path), problem))
            else:
                outcome = ("bad", None, skipped)
        status, chosen, skipped = broadcast_from_main(outcome)
        if status == "refused":
            raise CheckpointLoadError(f"cannot load {chosen}")
        for path, problem in skipped:
            self.log(f"[checkpoint] skipping {path}: {problem}")
        if status == "ok":
            if skipped:
                self.log(f"[checkpoint] resuming from {chosen} instead (--run.resume_fallback)")
            self._verified.add(Path(chosen).resolve())
            return Path(chosen)
        first, problem = skipped[0]
        if not self.resume_fallback:
            older = " (there are older checkpoints)" if len(candidates) > 1 else ""
            raise CheckpointCorrupt(f"checkpoint {first} is corrupt: {problem}; pass --run.resume_fallback true to "
                                    f"resume from the newest checkpoint that verifies{older}")
        raise CheckpointCorrupt("no checkpoint verifies: " + "; ".join(f"{p}: {why}" for p, why in skipped))

    def verify(self, path: str | Path) -> str | None:
        """None if the checkpoint at ``path`` is whole, else "<file>: <what is wrong>" (reads every file)."""
        path = Path(path)
        marker = path / MARKER
        try:
            text = marker.read_text()
        except OSError as exc:
            return f"{marker}: unreadable ({exc})"
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError:
            manifest = None
        if isinstance(manifest, int) or (manifest is None and text.strip().isdigit()):
            self.log(f"[checkpoint] warning: {path} has an old-format {MARKER} marker without checksums: unverified "
                     "(checking only for empty or truncated files)")
            for f in list_files(path):
                if problem := structural_problem(f):
                    return f"{f}: {problem}"
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            return f"{marker}: not a checkpoint manifest (torn or overwritten marker)"
        files = manifest["files"]
        for rel, meta in files.items():
            f = path / rel
            if not f.is_file():
                return f"{f}: missing"
            size = f.stat().st_size
            if size != meta["size"]:
                return f"{f}: {size} bytes, {meta['size']} when saved (truncated or overwritten)"
        names = sorted(files)
        hashes = hash_tree(path, [path / rel for rel in names])
        for rel in names:
            if hashes[rel]["sha256"] != files[rel]["sha256"]:
                return f"{path / rel}: sha256 differs from the one recorded at save (the file is corrupt)"
        return None

    def load(self, path: Path, engines: dict) -> dict:
        """Restore ``engines``, this rank's RNG state and return the trainer state (collective: every rank)."""
        path = Path(path)
        if path.resolve() not in self._verified:
            self._first_valid([path])  # raises naming the file when it does not verify
        for name, engine in engines.items():
            try:
                load_checkpoint(engine, path / name, tag="state")
            except CheckpointRefused as exc:
                raise CheckpointLoadError(f"cannot load {name}: {exc}") from None
            except Exception as exc:
                raise CheckpointLoadError(f"cannot load {name} from {path / name}: "
                                          f"{self._diagnose(path / name) or exc}") from exc
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            rng = self._read(rng_file, load_rng_file)
            set_rng_state(rng)
        state = self._read(path / "trainer_state.pt", load_torch_file)
        if self.rank == 0:
            self._remove_stale_temps()
        return state

    @staticmethod
    def _read(path: Path, reader):
        try:
            return reader(path)
        except CheckpointRefused as exc:
            raise CheckpointLoadError(f"cannot load {exc}") from None
        except Exception as exc:
            problem = (structural_problem(path) if path.exists() else "missing") or "unreadable"
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointLoadError(f"cannot load {path}: {problem} ({type(exc).__name__}: {first})") from exc

    @staticmethod
    def _diagnose(root: Path) -> str | None:
        if not root.exists():
            return "directory missing"
        for f in list_files(root):
            if problem := structural_problem(f):
                return f"{f}: {problem}"
        return None

    # ---- save -------------------------------------------------------------------------------------------
    def save(self, step: int, engines: dict, trainer_state: dict) -> Path:
        """Save on every rank (DeepSpeed writes per-rank shards); rank 0 verifies space and publishes the directory."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp_step_{step:08d}"
        needed = self._needed_bytes(engines)
        refusal = None
        if self.rank == 0:
            self._remove_stale_temps()
            self.root.mkdir(parents=True, exist_ok=True)
            refusal = self._make_room(step, needed, keep=final)
            if refusal is None:
                tmp.mkdir()
        refusal = broadcast_from_main(refusal)
        if refusal is not None:
            raise CheckpointSpaceError(refusal)
        barrier()
        try:
            for name, engine in engines.items():
                save_checkpoint(engine, tmp / name, tag="state", client_state={})
            torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        except Exception as exc:
            self._save_failed(step, tmp, needed, exc)
        barrier()
        if self.rank == 0:
            try:
                self._publish(step, tmp, final, trainer_state)
            except Exception as exc:
                self._save_failed(step, tmp, needed, exc)
            self._prune(keep=final)
        barrier()
        return final

    def _publish(self, step: int, tmp: Path, final: Path, trainer_state: dict) -> None:
        state_file = tmp / "trainer_state.pt"
        torch.save({"step": step, **trainer_state}, state_file)
        try:  # refuse now what could not be resumed later
            torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise TypeError(f"trainer state for step {step} does not load with weights_only=True (keep it to "
                            f"tensors and plain Python values): {exc}") from exc
        files = list_files(tmp)
        manifest = {"format": MARKER_FORMAT, "step": step, "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "files": hash_tree(tmp, files, sync=True)}
        with open(tmp / MARKER, "w") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for d in {p.parent for p in files} | {tmp}:
            fsync_dir(d)
        replace_dir(tmp, final)  # re-saving a step (e.g. after a resume) swaps the old one out in one rename
        fsync_dir(self.root)

    def _save_failed(self, step: int, tmp: Path, needed: int, exc: Exception):
        written = tree_size(tmp)
        free = _free_bytes(self.root)
        limit = hit_size_limit(tmp, _chain(exc))
        shutil.rmtree(tmp, ignore_errors=True)
        latest = self.latest()
        previous = f"the previous checkpoint {latest} is intact" if latest else "there is no earlier checkpoint"
        if limit is not None:
            raise CheckpointSaveError(
                f"cannot save checkpoint step {step} to {tmp}: a file reached this process's file-size limit "
                f"(ulimit -f: {fmt_bytes(limit)}); raise it (ulimit -f unlimited) and resume; the partial checkpoint "
                f"was removed and {previous}") from exc
        full = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _chain(exc))
        if full or free < max(needed - written, 16 << 20):
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointSpaceError(
                f"no space left on device saving checkpoint step {step} to {tmp}: about {fmt_bytes(needed)} "
                f"needed, {fmt_bytes(written)} written when it failed, {fmt_bytes(free)} free now; the partial "
                f"checkpoint was removed and {previous} (the error: {type(exc).__name__}: {first})") from exc
        exc.add_note(f"while saving checkpoint step {step} to {tmp} ({previous}; the partial one was removed)")
        raise exc

    def _needed_bytes(self, engines: dict) -> int:
        latest = self.latest()
        if latest is not None:
            return int(tree_size(latest) * _MARGIN)
        return int(sum(engine_bytes(e) for e in engines.values()) * _MARGIN)

    def check_room(self, engines: dict) -> None:
        """At start, once the engines are built: the first save will find room (the space it asks for, counting what
        its pruning frees), else CheckpointSpaceError now, before a step is trained (collective: every rank)."""
        refusal = None
        if self.rank == 0:
            needed, free = self._needed_bytes(engines), _free_bytes(self.root)
            done = self.complete_checkpoints()  # what the save's pruning removes first (never the newest)
            doomed = done[: max(0, len(done) + 1 - self.keep_last)][: len(done) - 1] if self.keep_last else []
            freed = sum(tree_size(p) for p in doomed)
            if free + freed < needed:
                refusal = (f"not enough space for this run's first checkpoint in {self.root}: about "
                           f"{fmt_bytes(needed)} needed, {fmt_bytes(free)} free; nothing was trained. Free space "
                           "or point --run.output_dir at a larger disk")
        refusal = broadcast_from_main(refusal)
        if refusal is not None:
            raise CheckpointSpaceError(refusal)

    def _make_room(self, step: int, needed: int, keep: Path) -> str | None:
        """None if ``needed`` bytes fit; else first prune what this save's pruning would delete anyway (never the
        newest checkpoint), then the reason it still does not fit."""
        free = _free_bytes(self.root)
        if free >= needed:
            return None
        done = [p for p in self.complete_checkpoints() if p != keep]
        doomed = done[: max(0, len(done) + 1 - self.keep_last)] if self.keep_last else []
        doomed = [p for p in doomed if p != done[-1]]
        for old in doomed:
            self.log(f"[checkpoint] low on space ({fmt_bytes(free)} free, {fmt_bytes(needed)} needed): removing "
                     f"{old.name} now, which keep_last={self.keep_last} would remove after this save")
            shutil.rmtree(old, ignore_errors=True)
            free = _free_bytes(self.root)
            if free >= needed:
                return None
        latest = self.latest()
        previous = f"the previous checkpoint {latest} is intact" if latest else "there is no earlier checkpoint"
        return (f"not enough space to save checkpoint step {step} in {self.root}: about {fmt_bytes(needed)} "
                f"({needed} bytes) needed, {fmt_bytes(free)} free; nothing was written and {previous}. Free space or "
                "point --run.output_dir at a larger disk")

    def _remove_stale_temps(self) -> None:
        if self.root.is_dir():
            for p in self.root.glob(".tmp_step_*"):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep: Path | None = None) -> None:
        """Delete all but the newest ``keep_last`` checkpoints (0: keep all); ``keep`` (just saved) always stays."""
        if self.keep_last == 0:
            return
        done = self.complete_checkpoints()
        others = [p for p in done if keep is None or p != keep]
        slots = self.keep_last - (1 if keep is not None and keep in done else 0)
        for old in others[: max(0, len(others) - slots)]:
            shutil.rmtree(old, ignore_errors=True)


def _free_bytes(path: Path) -> int:  # here, not in files.py: tests/run/test_run_safety.py patches it
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


__all__ = ["CheckpointCorrupt", "CheckpointLoadError", "CheckpointManager", "CheckpointSaveError",
           "CheckpointSpaceError"]
