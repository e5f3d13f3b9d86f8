"""The run directory's safety rules: one run per directory (a lock), and no fresh run on top of an earlier one.

`<run>/.lock` is a POSIX record lock (``fcntl.lockf``) taken by rank 0 before anything is written; the file holds the
holder's pid, host and start time so a refused run can say who has the directory. The kernel drops the lock when
the holding process exits, however it exits (``kill -9`` included), so a lock is never stale. Record locks belong
to the process, not to a file descriptor, so a child the trainer forks (vLLM, data workers) never inherits them and
cannot keep the directory locked after the trainer is gone; within one process the lock is re-entrant (tests build
several trainers on one directory).

`prepare_run_dir` refuses a fresh run (`run.resume` empty, or a checkpoint of another directory) in a directory that
holds an earlier run's complete checkpoints or exports (the new run's checkpoints would be mixed with the old ones,
pruned by step and resumed from by `latest`, and its export would replace the old one), or anything a run does not
write there (`RUN_FILES`: someone's files, or the wrong directory); `--run.output_dir ""`, the current directory, is
refused outright. `--run.resume latest` continues the old run; `--run.overwrite true`
starts fresh anyway and deletes only what a run wrote: the checkpoints (`step_*`, the best one, temp dirs), the
metrics and sample logs and the TensorBoard event files. The earlier exports (`export/`, `export_adapter/`) are
moved aside to `export.before-<time>` (they may hold files of yours, and they are the earlier run's model), and
anything else stays where it is.

This module imports neither torch nor DeepSpeed (a lock check must be cheap).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ds_rlhf.errors import UserInputError

STEP_DIR = re.compile(r"^step_(\d{8})$")
LOCK_NAME = ".lock"
# What runs write at the top of a run directory (the trainers, the run monitor, the telemetry, `ds-rlhf report`,
# wandb), and what a fresh run sets aside (`<name>.before-<time>`).
RUN_FILES = frozenset({LOCK_NAME, "config.json", "engine_budget.json", "metrics.jsonl", "samples.jsonl",
                       "status.json", "environment.json", "doctor.json", "checkpoints", "tensorboard", "export",
                       "export_adapter", "report", "wandb"})
_RUN_PATTERNS = re.compile(r"^(ds_config\.[\w-]+\.json|(metrics|samples)\.before-[\d-]+\.jsonl|"
                           r"(export|export_adapter)\.before-[\d-]+)$")
EXPORTS = ("export", "export_adapter")
_CHECKPOINT_ENTRY = re.compile(r"^(step_\d{8}|best|\.tmp_step_\d{8}|\.old_.*)$")


class RunDirError(UserInputError):
    """A run-directory or checkpoint problem the user must act on; the message says what to do."""


class RunDirLocked(RunDirError):
    pass


class ResumeNotFound(RunDirError, FileNotFoundError):
    """`--run.resume <path>` that is not a complete checkpoint."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The published checkpoints (`step_XXXXXXXX/COMPLETE`) under a `checkpoints` directory, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return sorted(found, key=step_of)


def broadcast_from_main(obj):
    """`obj` as rank 0 has it, on every rank (a no-op without a process group of more than one rank)."""
    if "torch" not in sys.modules:
        return obj
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- the lock --------------------------------------------------------------------------------------------------
_held: dict[str, list] = {}  # resolved lock path -> [fd, holder count]
_held_guard = threading.Lock()


class RunLock:
    """This process's hold on `<run>/.lock`; `release()` (idempotent) or process exit gives it up."""

    def __init__(self, path: Path):
        self.path = path
        self._released = False

    def release(self) -> None:
        with _held_guard:
            if self._released:
                return
            self._released = True
            entry = _held.get(str(self.path))
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[str(self.path)]
                with contextlib.suppress(OSError):
                    fcntl.lockf(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])

    @property
    def held(self) -> bool:
        return not self._released


def _holder_text(path: Path) -> str:
    try:
        info = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    except OSError:
        info = {}
    pid, host = info.get("pid", "?"), info.get("host", "?")
    text = f"pid {pid} on host {host}"
    if info.get("started"):
        text += f", started {info['started']}"
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            text += (f"; that pid is gone, so another process still holds the lock (find it with "
                     f"`fuser {path}`)")
        except PermissionError:
            pass
    return text


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Lock `run_dir` for this process (creating it); raise `RunDirLocked` naming the holder if another has it."""
    check_output_dir(run_dir)
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only file system
        raise RunDirError(f"run.output_dir={str(run_dir)!r} cannot be created ({exc.strerror or exc}): choose a "
                          "directory this user can write") from None
    path = (run_dir / LOCK_NAME).resolve()
    with _held_guard:
        entry = _held.get(str(path))
        if entry is not None:  # this process holds it already
            entry[1] += 1
            return RunLock(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # we held no lock on it, so closing releases nothing of ours
            raise RunDirLocked(f"run directory {run_dir} is in use by another run ({_holder_text(path)}); wait for "
                               "it to finish or pass another --run.output_dir") from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={stamp}\n".encode(), 0)
        _held[str(path)] = [fd, 1]
    lock = RunLock(path)
    atexit.register(lock.release)
    return lock


# ---- fresh run / resume / overwrite ------------------------------------------------------------------------------
def check_output_dir(run_dir: str | Path) -> None:
    """`--run.output_dir ""` would run in the current directory: refused (`RunDirError`)."""
    if not str(run_dir).strip():
        raise RunDirError("--run.output_dir is empty (that would be the current directory): pass the run's own "
                          "directory, e.g. --run.output_dir runs/sft")


def foreign_entries(run_dir: Path) -> list[str]:
    """The names at the top of `run_dir` that no run writes (`RUN_FILES`), sorted."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_FILES and not _RUN_PATTERNS.match(p.name))


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem, suffix = (path.name, "") if path.is_dir() else (path.stem, path.suffix)
    target = path.with_name(f"{stem}.before-{stamp}{suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{stem}.before-{stamp}-{n}{suffix}")
        n += 1
    os.replace(path, target)
    return target


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_resume_path(resume: str) -> Path:
    """`--run.resume <path>` -> that checkpoint directory, or `ResumeNotFound` in one line naming the path."""
    path = Path(resume)
    if not path.is_dir():
        raise ResumeNotFound(f"--run.resume {resume}: no such directory")
    if (path / "COMPLETE").is_file():
        return path
    if complete_checkpoints(checkpoints_dir(path)) or complete_checkpoints(path):
        runs = path if complete_checkpoints(checkpoints_dir(path)) else path.parent
        raise ResumeNotFound(f"--run.resume {resume}: a run directory, not a checkpoint; pass --run.resume latest "
                             f"--run.output_dir {runs}, or one of its checkpoints/step_* directories")
    raise ResumeNotFound(f"--run.resume {resume}: not a complete checkpoint (no COMPLETE marker in it)")


def prepare_run_dir(run_dir: str | Path, *, resume: str, overwrite: bool,
                    log: Callable[[str], None] = print) -> None:
    """Rank 0, with the lock held, before the run writes anything: refuse or clean up as the module docstring says."""
    run_dir = Path(run_dir)
    root = checkpoints_dir(run_dir)
    done = complete_checkpoints(root)
    own = resume == "latest" or (resume and Path(resume).resolve().parent == root.resolve())
    if resume and resume != "latest":
        check_resume_path(resume)
    if overwrite and own:
        raise RunDirError(f"--run.resume {resume} continues the run in {run_dir} and --run.overwrite true would "
                          "delete it: pass one of the two")
    if own and done:  # continuing this directory's run: its checkpoints and metrics are ours
        return
    # a fresh run (with `latest` and nothing to resume too: CheckpointManager.resolve says so)
    if done and not overwrite:
        raise RunDirError(f"run directory {run_dir} holds checkpoints of an earlier run (newest: {done[-1]}); pass "
                          "--run.resume latest to continue it, or --run.overwrite true to delete them and start fresh")
    exports = [run_dir / name for name in EXPORTS if (run_dir / name).exists()]
    if exports and not overwrite:
        raise RunDirError(f"run directory {run_dir} holds an earlier run's export ({_names([str(p) for p in exports])})"
                          "; pass another --run.output_dir, or --run.overwrite true to move it aside (to "
                          "export.before-<time>) and start fresh")
    foreign = foreign_entries(run_dir)
    if foreign and not overwrite:
        raise RunDirError(f"run directory {run_dir} holds files a run does not write ({_names(foreign)}); pass an "
                          "empty or new --run.output_dir, or --run.overwrite true to run there anyway (it only "
                          "deletes an earlier run's checkpoints and logs, never other files)")
    if overwrite:
        _overwrite(run_dir, done, exports, log)
        return
    _set_aside_old_logs(run_dir, log)


def _overwrite(run_dir: Path, done: list[Path], exports: list[Path], log: Callable[[str], None]) -> None:
    """Delete what an earlier run wrote (checkpoints, logs, TensorBoard events), move its exports aside."""
    removed = []
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        ours = [p for p in root.iterdir() if _CHECKPOINT_ENTRY.match(p.name)]
        for p in ours:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        _remove_if_empty(root)
        if ours:
            removed.append(root.name)
    for name in ("metrics.jsonl", "samples.jsonl"):
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
            removed.append(name)
    board = run_dir / "tensorboard"
    if board.is_dir():
        events = [p for p in board.rglob("events.out.tfevents.*") if p.is_file()]
        for p in events:
            p.unlink()
        for d in sorted((p for p in board.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _remove_if_empty(d)
        _remove_if_empty(board)
        if events:
            removed.append(board.name)
    if removed:
        log(f"[run] --run.overwrite: removed the earlier run's {', '.join(removed)} from {run_dir}"
            + (f" ({len(done)} checkpoints, newest {done[-1].name})" if done else ""))
    for path in exports:
        log(f"[run] --run.overwrite: moved the earlier run's {path} aside to {_move_aside(path).name}")


def _remove_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _set_aside_old_logs(run_dir: Path, log: Callable[[str], None]) -> None:
    """A fresh run in a directory whose earlier run left metrics (or sample logs) but no checkpoint (it died before
    the first save): keep the old logs under another name instead of appending to them."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if path.is_file() and path.stat().st_size > 0:
            moved = _move_aside(path)
            log(f"[run] {path} is from an earlier run without checkpoints: moved to {moved.name}")
