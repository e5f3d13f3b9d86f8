"""A store's files and figures against its manifest.

Opening a store checks it against its manifest (`StoreFormatError`, one line naming the store and the file): every
data file and lengths.npy has the size and sha256 recorded when it was written (`checksums`), and the manifest's
figures (rows per file and in all, token-length statistics) are those of the data. Hashing happens once per file
version: a verified file's size, mtime, ctime and inode go into `.verified.json` in the store (or, when the store is
read-only, a per-process cache), and later opens only compare those. A store written before checksums existed is
opened with a warning (once per process) to re-run its prep.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from .layout import MANIFEST
from .writer import file_checksum

log = logging.getLogger("ds_rlhf.data")


class StoreFormatError(ValueError):
    """The directory is not a readable store (missing manifest, truncated file, unknown version)."""



VERIFIED = ".verified.json"
_verified: dict[str, list] = {}  # "<file path>" -> [size, mtime_ns, ctime_ns, inode, sha256] verified (this process)
_unverifiable_warned: set[str] = set()


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def verify_store(path: Path, manifest: dict) -> None:
    """Refuse (StoreFormatError) a store whose files are not the ones its manifest recorded; see the module doc."""
    sums = manifest.get("checksums")
    if not isinstance(sums, dict):
        if str(path) not in _unverifiable_warned:
            _unverifiable_warned.add(str(path))
            log.warning("%s: the manifest has no checksums (a store from an older data prep): its files cannot be "
                        "verified; re-run the prep to add them", path)
        return
    wanted = [f["name"] for f in manifest["files"]] + [manifest["lengths_file"]]
    if missing := [name for name in wanted if name not in sums]:
        raise StoreFormatError(f"store {path}: {MANIFEST} has no checksum for {missing[0]} (the manifest was "
                               "modified; re-run data prep)")
    sidecar = path / VERIFIED
    try:
        cached = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        cached = {}
    fresh = {}
    for name in wanted:
        fpath = path / name
        if not fpath.is_file():
            raise StoreFormatError(f"store {path}: {fpath} is missing (re-run data prep)")
        key, want = _stat_key(fpath), sums[name]
        if key[0] != want["bytes"]:
            raise StoreFormatError(f"store {path}: {fpath} is {key[0]} bytes, {want['bytes']} when written "
                                   "(truncated or modified; re-run data prep)")
        verified = [*key, want["sha256"]]
        if _verified.get(str(fpath)) == verified or cached.get(name) == verified:
            _verified[str(fpath)] = verified
            continue
        if file_checksum(fpath)["sha256"] != want["sha256"]:
            raise StoreFormatError(f"store {path}: {fpath} has another sha256 than when it was written (the file is "
                                   "corrupt or was modified; re-run data prep)")
        _verified[str(fpath)] = fresh[name] = verified
    if fresh:
        try:
            tmp = sidecar.with_name(f"{VERIFIED}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**{k: v for k, v in cached.items() if k in wanted}, **fresh}) + "\n")
            os.replace(tmp, sidecar)
        except OSError:  # a read-only store: this process remembers
            pass


def check_figures(path: Path, manifest: dict, lengths: np.ndarray) -> None:
    """The manifest's row counts and token statistics are those of the data (StoreFormatError naming the file)."""
    lengths_file = path / manifest["lengths_file"]

    def differs(what: str, said, found, where: Path = lengths_file) -> StoreFormatError:
        return StoreFormatError(f"store {path}: {MANIFEST} says {what} {said} but {where} holds {found} (the manifest "
                                "or the data was modified; re-run data prep)")

    for info in manifest["files"]:
        rows = sum(b[2] for b in info["blocks"])
        if "rows" in info and rows != info["rows"]:
            raise differs(f"{info['name']} has", info["rows"], f"{rows} rows in its blocks", path / info["name"])
    cols = manifest["length_columns"]
    if lengths.ndim != 2 or lengths.shape[1] != len(cols):
        raise differs("the token columns are", cols, f"an array of shape {lengths.shape}")
    if len(lengths) != manifest["rows"]:
        raise differs("rows:", manifest["rows"], f"{len(lengths)} rows")
    written = manifest.get("row_counts", {}).get("written", manifest["rows"])
    if written != manifest["rows"]:
        raise differs("rows written:", written, f"{manifest['rows']} rows")
    for j, col in enumerate(cols):
        stats = manifest.get("token_stats", {}).get(col)
        if not stats or not stats.get("rows"):
            continue
        found = lengths[:, j]
        for key, value in (("rows", len(found)), ("min", int(found.min())), ("max", int(found.max())),
                           ("total", int(found.sum(dtype=np.int64)))):
            if key in stats and stats[key] != value:
                raise differs(f"{col} {key}", stats[key], value)
