"""The files of a run checkpoint: listing them, their sizes, sha256 digests for the `COMPLETE` manifest, cheap
structural checks (empty files, cut-short torch zip archives), the pickled globals they hold (read without loading
anything), the disk-space estimate of an engine's checkpoint and the file-size limit a save can run into.
Used by `manager.py:CheckpointManager`, which writes and verifies the manifest.
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ds_rlhf.engines.weights_only import CheckpointRefused, scan_torch_file

MARKER = "COMPLETE"
_CHUNK = 8 << 20
# what the RNG files of older checkpoints pickled (numpy's state tuple); `rng.load_rng_file` allows them
_RNG_GLOBALS = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
                "numpy.dtype", "numpy.dtypes.UInt32DType")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def list_files(root: Path) -> list[Path]:
    """Every file under ``root`` but the ``COMPLETE`` marker, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER)


def tree_size(root: Path) -> int:
    try:
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    except OSError:
        return 0


def hash_file(path: Path, *, sync: bool = False) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def hash_tree(root: Path, files: list[Path], *, sync: bool = False) -> dict[str, dict]:
    workers = max(1, min(8, os.cpu_count() or 1, len(files)))
    with ThreadPoolExecutor(workers) as pool:  # hashlib releases the GIL on large buffers
        results = list(pool.map(lambda p: hash_file(p, sync=sync), files))
    return {p.relative_to(root).as_posix(): {"size": size, "sha256": digest}
            for p, (size, digest) in zip(files, results)}


def structural_problem(path: Path) -> str | None:
    """Cheap checks that need no manifest: an empty file, or a torch zip archive cut short."""
    size = path.stat().st_size
    if size == 0:
        return "empty file (0 bytes)"
    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if zipped and not zipfile.is_zipfile(path):
        return f"truncated ({size} bytes: the zip archive has no end record)"
    return None


def refused_global(root: Path) -> str | None:
    """The refusal (one line naming the file and the global) for the first file under ``root`` that pickles a global
    its load would refuse; None when none does. Reads the pickles' opcodes only: nothing is loaded or run."""
    for path in list_files(root):
        allowed = _RNG_GLOBALS if path.name.startswith("rng_rank") else ()
        try:
            scan_torch_file(path, allowed)
        except CheckpointRefused as exc:
            return str(exc)
    return None


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (`ulimit -f`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def hit_size_limit(root: Path, errors) -> int | None:
    """The file-size limit when a failed write under ``root`` ran into it (an EFBIG among ``errors``, or a file
    written up to the limit: torch's writer reports the cut-off in its own words), else None."""
    limit = file_size_limit()
    if limit is None:
        return None
    if any(isinstance(e, OSError) and e.errno == errno.EFBIG for e in errors):
        return limit
    try:
        largest = max((p.stat().st_size for p in root.rglob("*") if p.is_file()), default=0)
    except OSError:
        return None
    return limit if largest >= limit else None


def engine_bytes(engine) -> int:
    """What a checkpoint of ``engine`` takes on disk, roughly: 12 bytes of fp32 master weights + Adam moments per
    trainable parameter, plus the module's own weights below ZeRO-3 (ZeRO-3 keeps them in the optimizer files)."""
    module = getattr(engine, "module", engine)
    trainable = weights = 0
    for p in module.parameters():
        numel = getattr(p, "ds_numel", None) or p.numel()
        if p.requires_grad:
            trainable += numel
        weights += numel * p.element_size()
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    return trainable * 12 + (weights if stage < 3 else 0)


__all__ = ["MARKER", "engine_bytes", "file_size_limit", "fmt_bytes", "hash_file", "hash_tree", "hit_size_limit",
           "list_files", "refused_global", "structural_problem", "tree_size"]
