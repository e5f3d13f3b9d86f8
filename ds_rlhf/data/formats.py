"""Read the input formats people already have, row by row, without hiding bad rows.

Sources: JSONL (optionally gzipped), a JSON array file, Parquet, a `datasets.save_to_disk` directory (a Dataset or
a DatasetDict + split), and a Hugging Face Hub dataset by name (`org/name[:config]`, one split, loaded with
`datasets.load_dataset`: from the datasets cache when offline, see `load_hub_dataset`). A directory that is not a
saved dataset is expanded to the data files inside.
Every row carries where it came from (file and line/row number), and a row that cannot be parsed is yielded as an
error row instead of being skipped, so the caller counts and reports it.
Fields and conversation shapes inside a row: `fields.py`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from .row_checks import RowError, loads_row  # RowError: why one row cannot be used (the converters raise it too)

DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


class DataPrepError(RuntimeError):
    """A bad input row under --on-error fail, or an input that cannot be read at all."""


@dataclass
class SourceRow:
    source_idx: int
    row_id: int         # JSONL: 1-based line number; tables: 0-based row index
    where: str          # "file.jsonl:12" or "file.parquet row 11", for messages
    data: dict | None   # None when `error` is set
    error: RowError | None = None


# A Hub dataset name: `org/name`, optionally `:config` (the dataset's configuration, e.g. openai/gsm8k:main).
HUB_DATASET = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?::(?P<config>[\w.-]+))?$")
HUB_DEFAULT_SPLIT = "train"


class HubDataset(type(Path())):
    """One split of a Hub dataset, loaded (`load_hub_dataset`). A path only in name: the readers name it like a
    file (`org/name:config`); its rows come from `.dataset`."""

    dataset: Any
    split: str


def is_hub_dataset_name(item) -> bool:
    """Whether an --input value is a Hub dataset name: `org/name[:config]`, not a path (no leading `/`, `.` or
    `~`, no data-file suffix) and nothing of that name on disk."""
    if not isinstance(item, str):
        return False
    return (not item.startswith(("/", ".", "~")) and not item.lower().endswith(DATA_SUFFIXES)
            and HUB_DATASET.match(item) is not None and not Path(item).exists())


def _downloads_off() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def load_hub_dataset(name: str, split: str | None = None) -> HubDataset:
    """`datasets.load_dataset(repo, config, split=split or "train")` as a source. The datasets cache is read first;
    it downloads only when downloads are allowed. A dataset not cached while offline, or one that cannot be loaded,
    is a one-line DataPrepError naming it and what to do."""
    from datasets import config as datasets_config
    from datasets import load_dataset

    match = HUB_DATASET.match(name)
    if match is None:
        raise DataPrepError(f"input {name!r} is not a Hub dataset name (org/name or org/name:config)")
    repo, config, split = match["repo"], match["config"], split or HUB_DEFAULT_SPLIT
    try:
        ds = load_dataset(repo, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        offline = _downloads_off() or bool(getattr(datasets_config, "HF_HUB_OFFLINE", False))
        if offline and isinstance(exc, (ConnectionError, FileNotFoundError)):
            args = ", ".join(repr(a) for a in (repo, config) if a)
            raise DataPrepError(
                f"input {name!r} is not a local file, and the Hub dataset {repo} (split {split!r}) is not in the "
                f"datasets cache {datasets_config.HF_DATASETS_CACHE} while downloads are off (HF_HUB_OFFLINE / "
                f"HF_DATASETS_OFFLINE): load it once on a machine with network and the same HF_HOME (python -c "
                f"\"import datasets; datasets.load_dataset({args}, split='{split}')\"), or pass a local file") from None
        raise DataPrepError(f"input {name!r}: cannot load the Hub dataset {repo} (split {split!r}): "
                            f"{_one_line(exc)}") from None
    source = HubDataset(name)
    source.dataset, source.split = ds, split
    return source


def detect_format(path: Path) -> str:
    if isinstance(path, HubDataset):
        return "hub_dataset"
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "hf_dir"
        raise DataPrepError(f"{path} is a directory but not a datasets.save_to_disk directory")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    if name.endswith((".json", ".json.gz")):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise DataPrepError(f"{path}: unknown input format (expected one of {DATA_SUFFIXES} or a saved dataset dir)")


def expand_inputs(inputs) -> list[Path]:
    """Files and dataset dirs to read, in a stable order; plain directories expand to their data files."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    out: list[Path] = []
    for item in inputs:
        if isinstance(item, HubDataset):
            out.append(item)
            continue
        p = Path(item)
        if not p.exists():
            raise DataPrepError(f"input {p} does not exist")
        if not p.is_dir() and not p.is_file():
            raise DataPrepError(f"input {p} is not a regular file (a FIFO, socket or device): pass a data file, "
                                "a directory of them or a saved dataset")
        if p.is_dir() and not ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(DATA_SUFFIXES))
            if not found:
                raise DataPrepError(f"{p}: no data files ({', '.join(DATA_SUFFIXES)}) inside")
            out += found
        else:
            out.append(p)
    if not out:
        raise DataPrepError("no input given")
    return out


def _open_bytes(path: Path):
    """The file's bytes, gunzipped when it starts with the gzip magic. Decoding is per line (see `iter_rows`), so
    one undecodable byte spoils one row, not the whole file."""
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115 - the caller closes it


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unreadable(path: Path, exc: BaseException, where: str = "") -> DataPrepError:
    """The one-line error for an input that cannot be read at all (truncated gzip, corrupt Parquet, ...)."""
    return DataPrepError(f"cannot read {path}{where}: {_one_line(exc)} (is the file truncated or corrupt?)")


# What a truncated or corrupt file raises while it is read: gzip (EOFError, BadGzipFile/OSError, zlib.error),
# pyarrow (ArrowInvalid/ArrowIOError and friends), the OS (I/O and permission errors).
READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)
_BOM = b"\xef\xbb\xbf"


def _decode_line(raw: bytes) -> str:
    """UTF-8 text of one line; RowError("bad_encoding") saying where the first undecodable byte is."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.end].hex(" ")
        raise RowError("bad_encoding", f"not UTF-8: byte(s) {bad} at column {exc.start + 1} ({exc.reason}); "
                                       f"re-encode the file as UTF-8") from None


def count_rows(path: Path, fmt: str, split: str | None = None) -> int | None:
    """Row count for the progress bar when it is cheap to get; None otherwise (gzipped or JSON files)."""
    if isinstance(path, HubDataset):
        return len(path.dataset)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except READ_ERRORS as exc:  # no valid footer: fail now, before any other input is converted
            raise unreadable(path, exc) from exc
    try:
        if fmt == "jsonl" and not path.name.endswith(".gz"):
            with open(path, "rb") as fh:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    except OSError:
        return None  # reading it for real reports the problem
    return None


def _load_hf(path: Path, split: str | None):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(path))
    if isinstance(ds, DatasetDict):
        splits = list(ds.keys())
        if split is None:
            if len(splits) != 1:
                raise DataPrepError(f"{path} holds splits {splits}; choose one with --split")
            split = splits[0]
        if split not in ds:
            raise DataPrepError(f"{path}: split {split!r} not found (have {splits})")
        ds = ds[split]
    return ds


def iter_rows(path: Path, source_idx: int = 0, split: str | None = None) -> Iterator[SourceRow]:
    """Yield every row of one source; unparsable rows come out with `error` set (never silently skipped).

    A line that is not UTF-8 is such a row (reason "bad_encoding"); a file that cannot be read on (truncated
    gzip, corrupt Parquet, I/O error) raises a one-line DataPrepError naming it, as no row after it can be read.
    """
    fmt = detect_format(path)
    if fmt == "jsonl" or (fmt == "json" and not _is_json_array(path)):
        yield from _iter_jsonl(path, source_idx)
    elif fmt == "json":
        yield from _iter_json_array(path, source_idx)
    elif fmt == "parquet":
        yield from _iter_parquet(path, source_idx)
    elif fmt == "hub_dataset":
        yield from _iter_dataset(path, source_idx, lambda: path.dataset)
    else:
        yield from _iter_dataset(path, source_idx, lambda: _load_hf(path, split))


def _iter_jsonl(path: Path, source_idx: int) -> Iterator[SourceRow]:
    name, lineno = path.name, 0
    try:
        with _open_bytes(path) as fh:
            for lineno, raw in enumerate(fh, start=1):
                if lineno == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                if not raw.strip():
                    continue  # blank lines (often a trailing newline) are not rows
                where = f"{name}:{lineno}"
                try:
                    obj = loads_row(_decode_line(raw))
                except RowError as err:
                    yield SourceRow(source_idx, lineno, where, None, err)
                    continue
                except json.JSONDecodeError as exc:
                    yield SourceRow(source_idx, lineno, where, None, RowError("malformed_json", str(exc)))
                    continue
                if not isinstance(obj, dict):
                    err = RowError("malformed_json", f"expected a JSON object, got {type(obj).__name__}")
                    yield SourceRow(source_idx, lineno, where, None, err)
                    continue
                yield SourceRow(source_idx, lineno, where, obj)
    except READ_ERRORS as exc:
        raise unreadable(path, exc, f" after line {lineno}" if lineno else "") from exc


def _iter_json_array(path: Path, source_idx: int) -> Iterator[SourceRow]:
    try:
        with _open_bytes(path) as fh:
            raw = fh.read()
    except READ_ERRORS as exc:
        raise unreadable(path, exc) from exc
    try:
        items = loads_row(raw.decode("utf-8-sig"))
    except RowError as exc:  # parsed whole: a duplicate key or a deep nest anywhere refuses the file
        raise DataPrepError(f"{path}: {exc.reason}: {exc.detail} (a JSON array is parsed whole; JSONL is read row "
                            "by row, so one bad row is skipped there)") from None
    except UnicodeDecodeError as exc:
        raise DataPrepError(f"{path}: not UTF-8 (byte(s) {raw[exc.start:exc.end].hex(' ')} at offset {exc.start}); "
                            f"a JSON array is parsed whole, so re-encode the file as UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise DataPrepError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(items, list):
        raise DataPrepError(f"{path}: expected a JSON array of objects, got {type(items).__name__}")
    for i, obj in enumerate(items):
        where = f"{path.name} item {i}"
        if isinstance(obj, dict):
            yield SourceRow(source_idx, i, where, obj)
        else:
            yield SourceRow(source_idx, i, where, None,
                            RowError("malformed_json", f"expected a JSON object, got {type(obj).__name__}"))


def _iter_parquet(path: Path, source_idx: int) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    i = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for obj in batch.to_pylist():
                yield SourceRow(source_idx, i, f"{path.name} row {i}", obj)
                i += 1
    except READ_ERRORS as exc:
        raise unreadable(path, exc, f" at row {i}" if i else "") from exc


def _iter_dataset(path: Path, source_idx: int, load) -> Iterator[SourceRow]:
    """Rows of a `datasets.Dataset` (`load()`: a saved dataset dir's split, or a loaded Hub dataset)."""
    i = 0
    try:
        ds = load().with_format(None)  # plain python rows whatever format was saved
        for batch in ds.iter(batch_size=1024):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys)):
                yield SourceRow(source_idx, i, f"{path.name} row {i}", dict(zip(keys, values)))
                i += 1
    except (*READ_ERRORS, ValueError, KeyError) as exc:  # corrupt state.json / Arrow files (DataPrepError passes)
        raise unreadable(path, exc, f" at row {i}" if i else "") from exc


def _is_json_array(path: Path) -> bool:
    try:
        with _open_bytes(path) as fh:
            head = fh.read(4096)
    except READ_ERRORS as exc:
        raise unreadable(path, exc) from exc
    return head.removeprefix(_BOM).lstrip().startswith(b"[")


def _sha256_file(path: Path) -> tuple[str, int]:
    h, total = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
            total += len(chunk)
    return h.hexdigest(), total


def source_info(path: Path, fmt: str) -> dict:
    """Path, format, size and sha256 of a source; a dataset dir hashes (relative name, file hash) in name order; a
    Hub dataset records its name, split, row count and the datasets fingerprint of its cached data."""
    if isinstance(path, HubDataset):
        return {"path": str(path), "format": fmt, "split": path.split, "rows": len(path.dataset),
                "fingerprint": path.dataset._fingerprint}
    if path.is_dir():
        digest, total = hashlib.sha256(), 0
        for f in sorted(f for f in path.rglob("*") if f.is_file()):
            fh, n = _sha256_file(f)
            digest.update(f"{f.relative_to(path)}\0{fh}\n".encode())
            total += n
        sha = digest.hexdigest()
    else:
        sha, total = _sha256_file(path)
    return {"path": str(path.resolve()), "format": fmt, "bytes": total, "sha256": sha}
