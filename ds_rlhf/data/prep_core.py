"""Turn user datasets into a pre-tokenized store once, so a training run never tokenizes at start-up.

`run_prep` drives any converter over every input row, counts and reports every row it does not write (file,
line/row number, reason), honours ``on_error`` ("skip" counts and goes on, "fail" stops at the first bad row;
over-long rows follow ``overlong`` instead), and writes the store atomically with a manifest: sources and their
hashes, tokenizer name and fingerprint, max lengths, row counts, drops by reason.

Nothing is lost and nothing fails silently:

* 0 rows written is an error (naming the inputs and the drops by reason) unless ``allow_empty``: an empty file,
  a Parquet file with other columns or the wrong prep script for the file would otherwise only show at training.
* The store is built in ``.<out>.tmp-<pid>@<host>`` beside the output. ``overwrite`` swaps it in: the old store
  is renamed aside (``.<out>.old-<pid>@<host>``), the new one renamed in, then the old one deleted; a failure
  in between puts the old one back.
* Leftovers of a killed prep (its pid is dead; same host) are cleaned up by the next prep into the same output,
  and when it was killed mid-swap (no store at the output, the old one aside) the old store is put back first.
* One prep per output at a time: a prep holds ``.<out>.lock`` beside the output (an ``flock``, which the kernel drops
  when the process exits however it exits; the file names the holder and is removed at the end) from its checks to
  its swap. A second prep into the same output is refused naming the holder's pid and host, and a store that
  appeared at the output meanwhile (a prep on another host of a filesystem without locks) is not replaced without
  ``overwrite``.

The public entry points built on it (`prep_prompts`, `prep_gsm8k`, `prep_sft`, `prep_preferences`) live in
`ds_rlhf.data.prep`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .convert import Encoder
from .formats import DataPrepError, RowError, count_rows, detect_format, expand_inputs, iter_rows, source_info
from .layout import DROPPED, MANIFEST
from .row_checks import check_values
from .store import load_tokenizer, tokenizer_fingerprint
from .writer import StoreWriter, write_manifest

NEVER_FATAL = {"too_long"}  # over-length rows follow --truncate/--drop, not --on-error
log = logging.getLogger("ds_rlhf.data")


@dataclass
class PrepResult:
    """Where the store went and what happened; os.PathLike, so `open_store(result)` works."""

    path: Path
    manifest: dict
    elapsed_s: float = 0.0
    examples: dict = field(default_factory=dict)

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def dropped(self) -> dict[str, int]:
        return self.manifest["dropped_by_reason"]

    def summary(self) -> str:
        m, rows = self.manifest, self.manifest["row_counts"]
        files = m["files"]
        mb = sum(f["bytes"] for f in files) / 1e6
        rate = rows["read"] / self.elapsed_s if self.elapsed_s else 0.0
        lines = [f"{m['created_by']}: wrote {rows['written']} {m['kind']} rows to {self.path} "
                 f"({len(files)} file(s), {mb:.2f} MB) in {self.elapsed_s:.1f}s ({rate:.0f} rows/s)",
                 f"  read {rows['read']} rows from {len(m['sources'])} source(s); tokenizer {m['tokenizer']['name']} "
                 f"(fingerprint {m['tokenizer']['fingerprint'][:12]})"]
        if self.dropped:
            lines.append(f"  dropped {rows['dropped']}:")
            for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]):
                where = ", ".join(self.examples.get(reason, []))
                lines.append(f"    {reason}: {n}" + (f" (e.g. {where})" if where else ""))
            lines.append(f"  every dropped row: {self.path / DROPPED}")
        else:
            lines.append("  dropped 0")
        for key, n in sorted(m["notes"].items()):
            lines.append(f"  {key}: {n}")
        for col, st in m["token_stats"].items():
            if st["rows"]:
                lines.append(f"  {col}: min {st['min']} / mean {st['mean']:.1f} / p99 {st['p99']} / max {st['max']} "
                             f"tokens (limit {m['max_lengths']})")
        return "\n".join(lines)


class _Report:
    def __init__(self, on_error: str, drop_file):
        if on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
        self.on_error = on_error
        self.read = self.written = 0
        self.dropped: Counter = Counter()
        self.notes: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.first_drop = ""
        self._drop_file = drop_file

    def note(self, key: str) -> None:
        self.notes[key] += 1

    def drop(self, src, err: RowError, source_path: str) -> None:
        if self.on_error == "fail" and err.reason not in NEVER_FATAL:
            raise DataPrepError(f"{src.where}: {err.reason}: {err.detail} "
                                f"(pass --on-error skip to drop such rows and continue)")
        self.dropped[err.reason] += 1
        if not self.first_drop:
            self.first_drop = f"{src.where}: {err.reason}: {err.detail}" if err.detail else f"{src.where}: {err.reason}"
        ex = self.examples.setdefault(err.reason, [])
        if len(ex) < 3:
            ex.append(src.where)
        self._drop_file.write(json.dumps({"source": source_path, "row_id": src.row_id, "where": src.where,
                                          "reason": err.reason, "detail": err.detail}, ensure_ascii=False) + "\n")


def _token_stats(lengths: np.ndarray, names: list[str]) -> dict:
    out = {}
    for j, name in enumerate(names):
        col = lengths[:, j] if len(lengths) else np.zeros(0, np.int32)
        out[name] = {"rows": int(len(col))}
        if len(col):
            out[name].update(min=int(col.min()), mean=float(col.mean()), p50=int(np.percentile(col, 50)),
                             p99=int(np.percentile(col, 99)), max=int(col.max()), total=int(col.sum()))
    return out


def _names(paths: list[Path]) -> str:
    shown = ", ".join(str(p) for p in paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _empty_error(paths: list[Path], report: _Report) -> DataPrepError:
    """0 rows kept: say from which inputs, what happened to the rows read, and how to allow it."""
    if report.read == 0:
        why = "the input has no rows (an empty file?)"
    else:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.dropped.items(), key=lambda kv: (-kv[1], kv[0])))
        first = " ".join(report.first_drop.split())
        first = first if len(first) <= 300 else first[:297] + "..."
        why = (f"{sum(report.dropped.values())} dropped ({reasons}); first: {first}. Is this the right prep script "
               f"and are the field names right for this file?")
    return DataPrepError(f"0 rows kept from {_names(paths)}: {why} (pass --allow-empty to write an empty store)")


# -- temp dirs and the swap -------------------------------------------------------------------------------------
_HOST = socket.gethostname()


def _tag() -> str:
    return f"{os.getpid()}@{_HOST}"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _leftovers(out: Path) -> list[tuple[str, Path]]:
    """("tmp" | "old", path) of dirs that killed preps into `out` left behind on this host (their pid is dead).

    Names without a host (`.<out>.tmp-<pid>`, the older form) count as this host's. Dirs of live processes and
    of other hosts (a shared filesystem) are never touched.
    """
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d+)(?:@(.+))?")
    found = []
    if not out.parent.is_dir():
        return found
    for entry in sorted(out.parent.iterdir()):
        m = pattern.fullmatch(entry.name)
        if m and entry.is_dir() and m.group(3) in (None, _HOST) and not _pid_alive(int(m.group(2))):
            found.append((m.group(1), entry))
    return found


def _recover(out: Path) -> None:
    """Clean up after killed preps into `out`; first put a complete old store back if it was killed mid-swap."""
    leftovers = _leftovers(out)
    if not out.exists():
        olds = [p for kind, p in leftovers if kind == "old" and (p / MANIFEST).is_file()]
        if olds:
            keep = max(olds, key=lambda p: (p / MANIFEST).stat().st_mtime)
            os.rename(keep, out)
            log.warning("%s: restored the store an interrupted prep had moved aside to %s", out, keep.name)
            leftovers = [(k, p) for k, p in leftovers if p != keep]
    for _, path in leftovers:
        log.warning("removing %s, left behind by a prep that was killed", path)
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def lock_output(out: Path):
    """Hold `.<out>.lock` beside `out` for the block (removed at its end); DataPrepError naming the holder when
    another prep has it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    for _ in range(5):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip().replace("\n", ", ") or "starting"
            os.close(fd)
            raise DataPrepError(f"{out} is being written by another prep ({holder}): wait for it to finish, or pass "
                                "another --output") from None
        try:  # the holder before us removes the file as it lets go: our lock must be on the file at `path`
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    else:
        raise DataPrepError(f"cannot lock {path}: other preps into {out} keep replacing it")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\nhost {_HOST}\nstarted {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(),
                  0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # still holding the lock: a prep that opened this file now finds it gone and retries
        os.close(fd)


def _swap_in(tmp: Path, out: Path, overwrite: bool = True) -> None:
    """Make the finished store at `tmp` the store at `out`; a crash or error at any point leaves a complete store
    (the old one at `out` or aside, which `_recover` puts back; or the new one at `out`)."""
    old = None
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataPrepError(f"{out} appeared while this prep ran (another prep wrote it); pass --overwrite to "
                            "replace it")
    if out.exists():
        old = out.parent / f".{out.name}.old-{_tag()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_dir() and not any(
            (Path(tokenizer) / name).is_file() for name in TOKENIZER_FILES):
        raise DataPrepError(f"--tokenizer={str(tokenizer)!r} is a directory without tokenizer files (none of "
                            f"{', '.join(TOKENIZER_FILES)}); pass the model directory that holds the tokenizer, or "
                            "a Hugging Face Hub id")
    try:
        return load_tokenizer(tokenizer)
    except (OSError, ValueError) as exc:
        raise DataPrepError(f"cannot load the tokenizer {tokenizer}: {' '.join(str(exc).split())}") from exc


def _prepare_output(out: Path, overwrite: bool) -> Path:
    """Check that `out` may be written (after cleaning up killed preps) and return a fresh temp dir beside it."""
    _recover(out)
    if out.is_file():
        raise DataPrepError(f"{out} is a file; --output must be a directory")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise DataPrepError(f"{out} exists and is not empty; pass --overwrite to replace it")
        if out.is_dir() and not (out / MANIFEST).exists():
            raise DataPrepError(f"{out} exists and is not a store; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{_tag()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _write_rows(paths: list[Path], fmts: list, split: str | None, convert, writer: StoreWriter, drop_path: Path, *,
                on_error: str, created_by: str, progress: bool) -> _Report:
    """Convert every input row into `writer`; dropped rows go to `drop_path` and the returned report."""
    counts = [count_rows(p, f) for p, f in zip(paths, fmts)]
    total = sum(counts) if all(c is not None for c in counts) else None
    with open(drop_path, "w", encoding="utf-8") as drop_file, \
            tqdm(total=total, unit="row", desc=created_by, disable=not progress, dynamic_ncols=True) as bar:
        report = _Report(on_error, drop_file)
        for si, path in enumerate(paths):
            for src in iter_rows(path, si, split):
                bar.update(1)
                report.read += 1
                try:
                    if src.error is not None:
                        raise src.error
                    check_values(src.data)
                    row = convert(src.data, report.note)
                except RowError as err:
                    report.drop(src, err, str(path))
                    continue
                row["row_id"], row["source_idx"] = src.row_id, si
                writer.add(row)
                report.written += 1
                if report.written % 256 == 0:
                    bar.set_postfix(written=report.written, dropped=sum(report.dropped.values()))
    return report


def _manifest(kind: str, created_by: str, paths: list[Path], fmts: list, tok, tok_name: str, options: dict,
              max_lengths: dict, report: _Report, layout: dict, lengths: np.ndarray, convert) -> dict:
    return {
        "format_version": layout["format_version"], "kind": kind, "created_by": created_by,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sources": [source_info(p, f) for p, f in zip(paths, fmts)],
        "tokenizer": {"name": tok_name, "fingerprint": tokenizer_fingerprint(tok),
                      "chat_template_applied": bool(options.get("apply_chat_template", True))},
        "max_lengths": max_lengths, "options": options,
        "rows": layout["rows"],
        "row_counts": {"read": report.read, "written": layout["rows"], "dropped": sum(report.dropped.values())},
        "dropped_by_reason": dict(report.dropped), "drop_report": DROPPED, "notes": dict(report.notes),
        "fields_used": getattr(convert, "fields_used", {}),
        "token_stats": _token_stats(lengths, layout["length_columns"]),
        **{k: layout[k] for k in ("files", "lengths_file", "length_columns", "schema", "checksums")},
    }


def run_prep(kind: str, inputs, output, tokenizer, make_converter, *, created_by: str, options: dict,
             max_lengths: dict, on_error: str = "skip", split: str | None = None, overwrite: bool = False,
             progress: bool = True, block_rows: int = 2048, allow_empty: bool = False) -> PrepResult:
    """Read `inputs`, convert each row with `make_converter(encoder)`, write a `kind` store at `output`.

    Raises DataPrepError when no row is kept (unless `allow_empty`), when an input cannot be read, or on the first
    bad row under ``on_error="fail"``; nothing is written at `output` then.
    """
    t0 = time.time()
    tok, tok_name = _load_tokenizer(tokenizer)
    paths = expand_inputs(inputs)
    fmts = [detect_format(p) for p in paths]
    out = Path(output)
    with lock_output(out):
        tmp = _prepare_output(out, overwrite)
        try:
            enc = Encoder(tok, system_prompt=options.get("system_prompt"))
            convert = make_converter(enc)
            writer = StoreWriter(tmp, kind, block_rows=block_rows)
            report = _write_rows(paths, fmts, split, convert, writer, tmp / DROPPED, on_error=on_error,
                                 created_by=created_by, progress=progress)
            if report.written == 0 and not allow_empty:
                raise _empty_error(paths, report)
            layout = writer.close()
            lengths = np.load(tmp / layout["lengths_file"])
            manifest = _manifest(kind, created_by, paths, fmts, tok, tok_name, options, max_lengths, report, layout,
                                 lengths, convert)
            write_manifest(tmp, manifest)
            _swap_in(tmp, out, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return PrepResult(out, manifest, time.time() - t0, report.examples)
