"""Write a store: rows -> Arrow IPC file(s) in blocks, recording each block's byte range, plus lengths.npy, and the
size and sha256 of each of those files (`checksums`, which `store.Store` verifies on open).

Blocks are small (default: 1 MiB of tokens or 2048 rows, whichever comes first) because a block is the unit the
loader reads: random access costs at most one block per sample, and a sequential scan merges neighbouring blocks
into large reads anyway. The writer is used by data_prep (row dicts) and by the benchmark (prebuilt batches).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from ds_rlhf.atomic_files import write_text_atomic

from .layout import DATA_FILE, FORMAT_VERSION, LENGTHS, MANIFEST, SCHEMAS, TOKEN_COLUMNS


class StoreWriter:
    """Append rows (dicts) or record batches of one store kind; `close()` returns the manifest's layout part.

    `file_rows` starts a new Arrow file every that many rows (None: one file), so very large stores can be
    copied or checksummed piecewise.
    """

    def __init__(self, out_dir: str | os.PathLike, kind: str, *, block_rows: int = 2048, block_bytes: int = 1 << 20,
                 file_rows: int | None = None):
        if kind not in SCHEMAS:
            raise ValueError(f"unknown store kind {kind!r}; expected one of {sorted(SCHEMAS)}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.schema = SCHEMAS[kind]
        self.block_rows = max(1, block_rows)
        self.block_bytes = max(1, block_bytes)
        self.file_rows = file_rows
        self._token_cols = TOKEN_COLUMNS[kind]
        self._pending: dict[str, list] = {name: [] for name in self.schema.names}
        self._pending_bytes = 0
        self._lengths: list[np.ndarray] = []
        self._files: list[dict] = []
        self._sink = self._writer = None
        self._file_rows_written = 0
        self.rows = 0

    # -- rows ---------------------------------------------------------------------------------------------
    def add(self, row: dict) -> None:
        """Buffer one row (column name -> python value); flushes a block when it is full."""
        for name in self.schema.names:
            self._pending[name].append(row.get(name))
        self._pending_bytes += sum(4 * len(row[c]) for c in self._token_cols)
        n = len(self._pending[self.schema.names[0]])
        in_file = self._file_rows_written if self.file_rows and self._file_rows_written < self.file_rows else 0
        file_full = bool(self.file_rows) and in_file + n >= self.file_rows  # end the block where the file ends
        if n >= self.block_rows or self._pending_bytes >= self.block_bytes or file_full:
            self._flush_pending()

    def _flush_pending(self) -> None:
        n = len(self._pending[self.schema.names[0]])
        if not n:
            return
        arrays = [pa.array(self._pending[f.name], type=f.type) for f in self.schema]
        self._pending = {name: [] for name in self.schema.names}
        self._pending_bytes = 0
        self.write_batch(pa.record_batch(arrays, schema=self.schema))

    # -- batches ------------------------------------------------------------------------------------------
    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Write one block as is (the caller chose its size). Columns must match the kind's schema."""
        if batch.schema.remove_metadata() != self.schema:
            batch = pa.record_batch([batch.column(f.name).cast(f.type) for f in self.schema], schema=self.schema)
        if self._writer is None or (self.file_rows and self._file_rows_written >= self.file_rows):
            self._open_next_file()
        start = self._sink.tell() if self._files[-1]["blocks"] else 8 + len(self.schema.serialize())
        self._writer.write_batch(batch)
        end = self._sink.tell()
        self._files[-1]["blocks"].append([start, end - start, batch.num_rows])
        self._files[-1]["rows"] += batch.num_rows
        self._file_rows_written += batch.num_rows
        self.rows += batch.num_rows
        lens = [np.diff(batch.column(c).offsets.to_numpy()).astype(np.int32) for c in self._token_cols]
        self._lengths.append(np.stack(lens, axis=1))

    def _open_next_file(self) -> None:
        self._close_file()
        name = DATA_FILE.format(len(self._files))
        self._sink = pa.OSFile(str(self.out_dir / name), "wb")
        # The first block starts after the 8-byte magic and the schema message (8 + len(schema.serialize())):
        # the IPC writer emits both lazily with the first batch, so tell() cannot give that offset.
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._files.append({"name": name, "rows": 0, "bytes": 0, "blocks": []})
        self._file_rows_written = 0

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._files[-1]["bytes"] = os.path.getsize(self.out_dir / self._files[-1]["name"])
            self._writer = self._sink = None

    def close(self) -> dict:
        """Flush, close the files, write lengths.npy; returns {"rows", "files", "length_columns", ...}."""
        self._flush_pending()
        if self._writer is None and not self._files:
            self._open_next_file()  # an empty store still gets a valid (empty) Arrow file
        self._close_file()
        k = len(self._token_cols)
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros((0, k), np.int32)
        np.save(self.out_dir / LENGTHS, lengths)
        names = [f["name"] for f in self._files] + [LENGTHS]
        return {"format_version": FORMAT_VERSION, "kind": self.kind, "rows": self.rows, "files": self._files,
                "lengths_file": LENGTHS, "length_columns": list(self._token_cols),
                "schema": {f.name: str(f.type) for f in self.schema},
                "checksums": {name: file_checksum(self.out_dir / name) for name in names}}


def file_checksum(path: str | os.PathLike) -> dict:
    """{"bytes": size, "sha256": hex digest} of one file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": digest}


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    path = Path(out_dir) / MANIFEST
    write_text_atomic(path, json.dumps(manifest, indent=1, sort_keys=False, ensure_ascii=False) + "\n")
    return path


def write_store(out_dir: str | os.PathLike, kind: str, items, *, tokenizer_name: str = "synthetic",
                tokenizer_fingerprint: str = "synthetic", block_rows: int = 2048, block_bytes: int = 1 << 20,
                file_rows: int | None = None, **manifest_extra) -> Path:
    """Write already-tokenized rows (dicts) or record batches as a store, without a source file.

    For benchmarks and tests, and for callers that tokenize themselves; data_prep is the normal way in.
    """
    from datetime import UTC, datetime

    writer = StoreWriter(out_dir, kind, block_rows=block_rows, block_bytes=block_bytes, file_rows=file_rows)
    for item in items:
        if isinstance(item, pa.RecordBatch):
            writer.write_batch(item)
        else:
            writer.add(item)
    layout = writer.close()
    manifest = {"format_version": layout["format_version"], "kind": kind, "created_by": "write_store",
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"), "sources": [],
                "tokenizer": {"name": tokenizer_name, "fingerprint": tokenizer_fingerprint},
                "rows": layout["rows"],
                **{k: layout[k] for k in ("files", "lengths_file", "length_columns", "schema", "checksums")},
                **manifest_extra}
    write_manifest(out_dir, manifest)
    return Path(out_dir)
