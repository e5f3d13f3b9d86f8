"""Open a pre-tokenized store and read rows, columns and lengths from it.

A store is tied to the tokenizer that produced it: token ids from another vocabulary are silently wrong, so
`open_store(..., tokenizer=...)` compares fingerprints and refuses a mismatch with `StoreMismatchError`.
Reads go through `readers.open_reader` (io_uring + O_DIRECT when available, else mmap); decoded blocks are kept
in a small LRU cache so a shuffled epoch over a store that fits in the cache reads each block once.

Opening a store checks its files and figures against its manifest (`store_checks.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa

from .layout import FORMAT_VERSION, MANIFEST, SCHEMAS, schema_problem
from .readers import open_reader
from .store_checks import StoreFormatError, check_figures, verify_store

log = logging.getLogger("ds_rlhf.data")


class StoreMismatchError(ValueError):
    """The store was written with another tokenizer (or is another kind) than the run expects."""


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable sha256 over what decides token ids: vocab, merges, normalizer, special tokens, chat template.

    Runtime settings (truncation/padding state, model_max_length, padding side) are left out on purpose, so the
    same tokenizer files always give the same fingerprint however the tokenizer object was configured.
    """
    parts: dict = {}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        parts["backend"] = state
    else:
        parts["vocab"] = sorted(tokenizer.get_vocab().items())
    parts["added"] = sorted(tokenizer.get_added_vocab().items())
    parts["special"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    parts["chat_template"] = getattr(tokenizer, "chat_template", None)
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def load_tokenizer(tokenizer):
    """Accept a tokenizer object or a local path / name; return (tokenizer, display name)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer)), str(tokenizer)
    return tokenizer, str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class _Block:
    """One decoded record batch with numpy views of its columns, so per-row access is cheap."""

    __slots__ = ("batch", "lists", "scalars", "nbytes")

    def __init__(self, batch: pa.RecordBatch, nbytes: int):
        self.batch = batch
        self.nbytes = nbytes
        self.lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.scalars: dict[str, list] = {}
        for field, col in zip(batch.schema, batch.columns):
            if pa.types.is_list(field.type):
                self.lists[field.name] = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False))
            else:
                self.scalars[field.name] = col.to_pylist()

    def row(self, j: int, as_numpy: bool) -> dict:
        out = {}
        for name, (offsets, values) in self.lists.items():
            piece = values[offsets[j]:offsets[j + 1]]
            out[name] = piece if as_numpy else piece.tolist()
        for name, values in self.scalars.items():
            out[name] = values[j]
        return out


class Store:
    """A read-only view of one store directory. Use `open_store` to get one (it checks the tokenizer)."""

    def __init__(self, path: str | os.PathLike, *, reader: str = "auto", cache_bytes: int = 1 << 30):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            aside = sorted(self.path.parent.glob(f".{self.path.name}.old-*")) if self.path.parent.is_dir() else []
            hint = " (run a data_prep script)"
            if aside:
                hint = (f"; a data prep killed while replacing it left the old store at {aside[-1]}: run the prep "
                        f"again (it puts that store back first) or rename it back")
            raise StoreFormatError(f"{self.path} is not a store: {MANIFEST} is missing{hint}")
        self.manifest: dict = json.loads(mpath.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise StoreFormatError(f"{self.path}: store format {self.manifest.get('format_version')} is not "
                                   f"{FORMAT_VERSION}; re-run data_prep with this version")
        self.kind: str = self.manifest["kind"]
        self.schema = SCHEMAS[self.kind]
        verify_store(self.path, self.manifest)
        self._readers, notes = [], set()
        blocks = []
        for fi, info in enumerate(self.manifest["files"]):
            fpath = self.path / info["name"]
            if not fpath.is_file() or fpath.stat().st_size != info["bytes"]:
                size = fpath.stat().st_size if fpath.is_file() else "missing"
                raise StoreFormatError(f"{fpath}: expected {info['bytes']} bytes, found {size} (truncated or "
                                       f"modified store; re-run data_prep)")
            if problem := schema_problem(fpath, self.kind):  # now, not as a pyarrow error deep in a run
                for opened in self._readers:
                    opened.close()
                raise StoreFormatError(f"store {self.path}: {problem}")
            r, note = open_reader(fpath, reader)
            self._readers.append(r)
            if note:
                notes.add(note)
            blocks += [(fi, off, length, rows) for off, length, rows in info["blocks"]]
        self.reader_kind: str = self._readers[0].kind if self._readers else "none"
        self.reader_note = "; ".join(sorted(notes))
        self._blocks = blocks
        counts = np.array([b[3] for b in blocks], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._n = int(self._starts[-1])
        if self._n != self.manifest["rows"]:
            raise StoreFormatError(f"{self.path}: blocks hold {self._n} rows but the manifest says "
                                   f"{self.manifest['rows']}")
        self._cache: OrderedDict[int, _Block] = OrderedDict()
        self._cache_bytes = 0
        self.cache_limit = cache_bytes
        self._lock = threading.Lock()
        self._lengths_2d: np.ndarray | None = None
        try:
            check_figures(self.path, self.manifest, self._length_table())
        except BaseException:
            self.close()
            raise
        log.info("opened %s store %s: %d rows, reader %s%s", self.kind, self.path, self._n, self.reader_kind,
                 f" ({self.reader_note})" if self.reader_note else "")

    # -- sizes --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return sum(f["bytes"] for f in self.manifest["files"])

    def _length_table(self) -> np.ndarray:
        if self._lengths_2d is None:
            self._lengths_2d = np.load(self.path / self.manifest["lengths_file"])
        return self._lengths_2d

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per row (int64): the sequence for prompts/sft, chosen + rejected for preference pairs."""
        return self._length_table().sum(axis=1, dtype=np.int64)

    def column_lengths(self, name: str) -> np.ndarray:
        cols = self.manifest["length_columns"]
        if name not in cols:
            raise KeyError(f"{name!r} is not a token column of a {self.kind} store ({cols})")
        return self._length_table()[:, cols.index(name)].astype(np.int64)

    # -- blocks -------------------------------------------------------------------------------------------
    def block_of(self, i: int) -> tuple[int, int]:
        """(block index, row within the block) for global row i."""
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} out of range for a store of {self._n} rows")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    @property
    def block_starts(self) -> np.ndarray:
        """First global row of each block, plus the row count at the end ([num_blocks + 1], int64)."""
        return self._starts

    def blocks_of(self, indices) -> np.ndarray:
        """Block index of each global row index (vectorised)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"row index out of range for a store of {self._n} rows")
        return np.searchsorted(self._starts, idx, side="right") - 1

    def load_blocks(self, ks) -> dict[int, _Block]:
        """Decoded blocks by index; the missing ones are read together (one io_uring submission per file)."""
        ks = list(dict.fromkeys(int(k) for k in ks))
        with self._lock:
            found = {k: self._cache[k] for k in ks if k in self._cache}
            for k in found:
                self._cache.move_to_end(k)
        missing = [k for k in ks if k not in found]
        by_file: dict[int, list[int]] = {}
        for k in missing:
            by_file.setdefault(self._blocks[k][0], []).append(k)
        for fi, kk in by_file.items():
            bufs = self._readers[fi].read_ranges([(self._blocks[k][1], self._blocks[k][2]) for k in kk])
            for k, buf in zip(kk, bufs):
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(buf), self.schema)
                found[k] = _Block(batch, self._blocks[k][2])
        with self._lock:
            for k in missing:
                if k not in self._cache:
                    self._cache[k] = found[k]
                    self._cache_bytes += found[k].nbytes
            while self._cache_bytes > self.cache_limit and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes
        return found

    def block(self, k: int) -> pa.RecordBatch:
        return self.load_blocks([k])[k].batch

    def _read_uncached(self, ks: list[int]) -> list[pa.Buffer]:
        out: dict[int, pa.Buffer] = {}
        by_file: dict[int, list[int]] = {}
        for k in ks:
            by_file.setdefault(self._blocks[k][0], []).append(k)
        for fi, kk in by_file.items():
            bufs = self._readers[fi].read_ranges([(self._blocks[k][1], self._blocks[k][2]) for k in kk])
            out.update(zip(kk, bufs))
        return [out[k] for k in ks]

    def iter_batches(self, blocks_per_read: int = 16):
        """Yield every block's RecordBatch in order; a helper thread reads the next `blocks_per_read` blocks
        while the caller works on the current ones. Bypasses the cache (a scan would only evict useful blocks)."""
        from concurrent.futures import ThreadPoolExecutor

        groups = [list(range(a, min(a + blocks_per_read, self.num_blocks)))
                  for a in range(0, self.num_blocks, blocks_per_read)]
        if not groups:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ds_rlhf-scan") as pool:
            pending = pool.submit(self._read_uncached, groups[0])
            for g in range(len(groups)):
                bufs = pending.result()
                if g + 1 < len(groups):
                    pending = pool.submit(self._read_uncached, groups[g + 1])
                for buf in bufs:
                    yield pa.ipc.read_record_batch(pa.ipc.read_message(buf), self.schema)
                del bufs

    # -- rows and columns ---------------------------------------------------------------------------------
    def rows(self, indices, *, as_numpy: bool = False) -> list[dict]:
        """Rows as dicts (token columns as lists, or numpy views with as_numpy); adds "index" (the row number)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        ks = self.blocks_of(idx)
        blocks = self.load_blocks(ks.tolist())
        out = []
        for i, k, j in zip(idx.tolist(), ks.tolist(), (idx - self._starts[ks]).tolist()):
            row = blocks[k].row(j, as_numpy)
            row["index"] = i
            out.append(row)
        return out

    def row(self, i: int, *, as_numpy: bool = False) -> dict:
        return self.rows([i], as_numpy=as_numpy)[0]

    def __getitem__(self, i: int) -> dict:
        return self.row(i)

    def column(self, name: str) -> pa.ChunkedArray:
        if name not in self.schema.names:
            raise KeyError(f"{name!r} is not a column of a {self.kind} store ({self.schema.names})")
        return pa.chunked_array([b.column(name) for b in self.iter_batches()], type=self.schema.field(name).type)

    def to_table(self) -> pa.Table:
        return pa.Table.from_batches(list(self.iter_batches()), schema=self.schema)

    def close(self) -> None:
        self._cache.clear()  # drop our views first, so an mmap reader can unmap
        self._cache_bytes = 0
        for r in self._readers:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, kind={self.kind!r}, rows={self._n}, reader={self.reader_kind!r})"


def open_store(path, tokenizer=None, expect_kind: str | None = None, *, reader: str = "auto",
               cache_bytes: int = 1 << 30) -> Store:
    """Open a store; refuse it (StoreMismatchError) when its kind or tokenizer differs from what the run uses.

    `tokenizer` may be a tokenizer object or a local tokenizer path; None skips the check (e.g. for inspection).
    """
    store = Store(os.fspath(path), reader=reader, cache_bytes=cache_bytes)
    try:
        check_store(store, tokenizer, expect_kind)
    except StoreMismatchError:
        store.close()
        raise
    return store


def check_store(store: Store, tokenizer=None, expect_kind: str | None = None) -> None:
    """Raise StoreMismatchError when the store's kind or tokenizer fingerprint is not what the run uses."""
    if expect_kind is not None and store.kind != expect_kind:
        raise StoreMismatchError(f"{store.path} holds a {store.kind!r} store, but a {expect_kind!r} store is "
                                 f"needed here (prepare it with the matching data_prep script)")
    if tokenizer is not None:
        tok, name = load_tokenizer(tokenizer)
        want = tokenizer_fingerprint(tok)
        info = store.manifest["tokenizer"]
        if info["fingerprint"] != want:
            raise StoreMismatchError(
                f"{store.path} was tokenized with {info['name']} (fingerprint {info['fingerprint'][:12]}), but this "
                f"run's tokenizer {name} has fingerprint {want[:12]}: token ids would be wrong. Re-run data_prep "
                f"with --tokenizer {name}, or point the run at the tokenizer the store was built with.")
