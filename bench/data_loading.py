"""Data loading benchmark: a >= 2 GiB synthetic SFT store, read cold and warm three ways.

    python bench/data_loading.py [--dir /tmp/ds_rlhf_data_bench] [--size_gib 2] [--keep]

Methods: our store through io_uring + O_DIRECT, the same store through mmap, and a `datasets.save_to_disk` copy
read with `datasets.load_from_disk`. "scan" decodes every record batch and touches every 4 KiB page of its token
buffers (so mmap really faults every page in); "loader" is the training path: StoreLoader batches of python rows
(or numpy rows, "numpy") in shuffled order with the prefetch thread; the datasets counterpart is
`load_from_disk(...).shuffle(seed).iter(batch_size)`. Prints GB/s (store bytes / wall time) and samples/s.

Cold means the file's pages are not in the page cache: we try `echo 3 > /proc/sys/vm/drop_caches`, and when that
is denied (containers) we evict each file with posix_fadvise(POSIX_FADV_DONTNEED) after fsync, and report the
resident fraction measured with mincore(2) before each cold run. O_DIRECT never uses the page cache, so its cold
and warm runs differ only by chance. On a VM the host may still cache the disk image; numbers are then an upper
bound for a truly cold disk. Files go under --dir (default /tmp), never into the repository.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from ds_rlhf.data import StoreLoader, open_store
from ds_rlhf.data.layout import MANIFEST, SCHEMAS
from ds_rlhf.data.writer import StoreWriter, write_manifest

STRIDE = 1024  # int32 elements per 4 KiB page


# -- page cache control ---------------------------------------------------------------------------------------
def drop_caches() -> tuple[bool, str]:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True, "dropped with /proc/sys/vm/drop_caches"
    except OSError as exc:
        return False, f"drop_caches denied ({exc.strerror}); evicting files with posix_fadvise(DONTNEED)"


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(paths) -> float:
    """Fraction of the files' pages in the page cache (mincore on a fresh, untouched mapping)."""
    resident = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) == 0:
                resident += int(np.frombuffer(vec, np.uint8).astype(bool).sum())
                total += pages
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# -- data -----------------------------------------------------------------------------------------------------
def build_store(path: Path, size_bytes: int, block_bytes: int, seed: int) -> Path:
    """SFT rows of 256..2047 random tokens (mean ~1150, 5 bytes/token) until the files reach `size_bytes`."""
    if (path / MANIFEST).exists():
        m = json.loads((path / MANIFEST).read_text())
        if sum(f["bytes"] for f in m["files"]) >= size_bytes:
            return path
        shutil.rmtree(path)
    rng = np.random.default_rng(seed)
    schema = SCHEMAS["sft"]
    writer = StoreWriter(path, "sft", file_rows=200_000)
    written, row = 0, 0
    with tqdm(total=size_bytes, unit="B", unit_scale=True, desc="writing store") as bar:
        while written < size_bytes:
            lens = rng.integers(256, 2048, size=max(1, block_bytes // (5 * 1150)))
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 32000, offsets[-1],
                                                                                    dtype=np.int32)))
            mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(offsets[-1], np.int8)))
            n = len(lens)
            writer.write_batch(pa.record_batch([ids, mask, pa.array(np.arange(row, row + n)),
                                                pa.array(np.zeros(n, np.int32))], schema=schema))
            row += n
            grown = int(offsets[-1]) * 5 + n * 20
            written += grown
            bar.update(grown)
    layout = writer.close()
    write_manifest(path, {"format_version": layout["format_version"], "kind": "sft", "created_by": "bench",
                          "sources": [], "tokenizer": {"name": "synthetic", "fingerprint": "synthetic"},
                          "rows": layout["rows"], **{k: layout[k] for k in ("files", "lengths_file",
                                                                             "length_columns", "schema")}})
    return path


def build_hf_copy(store: Path, out: Path) -> Path:
    import datasets
    from datasets.table import InMemoryTable

    rows = json.loads((store / MANIFEST).read_text())["rows"]
    marker = out / "ds_rlhf_rows.txt"  # reuse only a copy of this very store
    if marker.exists() and marker.read_text() == str(rows):
        return out
    shutil.rmtree(out, ignore_errors=True)
    files = sorted(store.glob("data-*.arrow"))
    table = pa.concat_tables(pa.ipc.open_file(pa.memory_map(str(f))).read_all() for f in files)
    datasets.Dataset(InMemoryTable(table)).save_to_disk(str(out), max_shard_size="1GB")
    marker.write_text(str(rows))
    return out


def files_of(store: Path) -> list[Path]:
    return sorted(store.glob("data-*.arrow"))


# -- measurements ---------------------------------------------------------------------------------------------
def _touch(col) -> tuple[int, int]:
    """(checksum of one value per 4 KiB page, token count) for a list column or chunked list column."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    s = n = 0
    for c in chunks:
        values = np.asarray(c.flatten())  # zero-copy; respects slices (datasets hands out sliced chunks)
        s += int(values[::STRIDE].sum(dtype=np.int64))
        n += len(values)
    return s, n


def scan_store(path: Path, reader: str, blocks_per_read: int = 32) -> dict:
    t0 = time.perf_counter()
    store = open_store(path, reader=reader)
    rows = tokens = checksum = 0
    for batch in store.iter_batches(blocks_per_read=blocks_per_read):
        rows += batch.num_rows
        for name in ("input_ids", "loss_mask"):
            s, n = _touch(batch.column(name))
            checksum, tokens = checksum + s, tokens + n
    dt = time.perf_counter() - t0
    kind = store.reader_kind
    store.close()
    return {"seconds": dt, "rows": rows, "tokens": tokens, "checksum": checksum, "reader": kind}


def scan_datasets(path: Path, batch_size: int = 1024) -> dict:
    from datasets import load_from_disk

    t0 = time.perf_counter()
    ds = load_from_disk(str(path)).with_format("arrow")
    rows = tokens = 0
    for table in ds.iter(batch_size=batch_size):
        rows += table.num_rows
        for name in ("input_ids", "loss_mask"):
            tokens += _touch(table.column(name))[1]
    return {"seconds": time.perf_counter() - t0, "rows": rows, "tokens": tokens, "reader": "datasets (mmap)"}


def loader_run(path: Path, reader: str, batches: int, batch_size: int, as_numpy: bool = False) -> dict:
    t0 = time.perf_counter()
    loader = StoreLoader(path, batch_size, reader=reader, seed=0, prefetch=4, as_numpy=as_numpy)
    rows = tokens = 0
    it = iter(loader)
    for _ in range(batches):
        batch = next(it)
        rows += len(batch)
        tokens += sum(len(r["input_ids"]) for r in batch)
    dt = time.perf_counter() - t0
    it.close()
    kind, window = loader.reader_kind, loader.shuffle_window
    loader.close()
    return {"seconds": dt, "rows": rows, "tokens": tokens, "bytes": tokens * 5, "reader": kind,
            "shuffle_window": window}


def datasets_shuffled(path: Path, batches: int, batch_size: int) -> dict:
    from datasets import load_from_disk

    t0 = time.perf_counter()
    ds = load_from_disk(str(path)).shuffle(seed=0)
    rows = tokens = 0
    for i, batch in enumerate(ds.iter(batch_size=batch_size)):
        if i == batches:
            break
        rows += len(batch["input_ids"])
        tokens += sum(len(x) for x in batch["input_ids"])
    return {"seconds": time.perf_counter() - t0, "rows": rows, "tokens": tokens, "bytes": tokens * 5,
            "reader": "datasets shuffle()"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dir", default="/tmp/ds_rlhf_data_bench", help="where the store and its datasets copy go")
    ap.add_argument("--size_gib", type=float, default=2.0, help="store size (default 2 GiB)")
    ap.add_argument("--block_mib", type=float, default=1.0, help="bytes per record batch (the I/O unit)")
    ap.add_argument("--loader_batches", type=int, default=1500, help="batches per loader run")
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--blocks_per_read", type=int, default=64, help="blocks per io_uring submission in scans")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every measurement (medians are reported)")
    ap.add_argument("--skip_datasets", action="store_true", help="skip the datasets.load_from_disk runs")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep the files for another run (default: delete)")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    load_start = os.getloadavg()  # other tenants of a shared box show up here
    store = build_store(root / "store", int(args.size_gib * (1 << 30)), int(args.block_mib * (1 << 20)), seed=0)
    store_bytes = sum(p.stat().st_size for p in files_of(store))
    hf = None if args.skip_datasets else build_hf_copy(store, root / "hf")
    dropped, how = drop_caches()
    print(f"store: {store_bytes / 2**30:.2f} GiB in {len(files_of(store))} file(s), "
          f"{open_store(store).num_blocks} blocks; page cache: {how}")
    results = run_rounds(args, store, hf, store_bytes, dropped)
    summary = summarize(results, args.repeats)
    info = {"date": datetime.date.today().isoformat(), "cpu": _cpu(), "cores": os.cpu_count(),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "kernel": platform.release(), "store_bytes": store_bytes, "page_cache": how,
            "wall_s": time.time() - t_start, "summary": summary, "results": results,
            "args": vars(args)}
    scans = {r["checksum"] for r in results if "checksum" in r}
    assert len(scans) <= 1, f"the store scans read different data: {scans}"
    assert len({r["tokens"] for r in results if r["method"].startswith("scan")}) <= 1, "token counts differ"
    print(f"done in {info['wall_s']:.0f} s on {info['cores']} x {info['cpu']}, kernel {info['kernel']}; "
          f"load average {load_start[0]:.1f} at start, {info['loadavg_end'][0]:.1f} at end")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


def run_rounds(args, store: Path, hf: Path | None, store_bytes: int, dropped: bool) -> list[dict]:
    """Every method `--repeats` times, the rounds interleaving the methods; each result printed as it comes."""
    hf_files = [] if hf is None else sorted(hf.glob("*.arrow"))
    results: list[dict] = []

    def record(method, temp, res, nbytes, resident, rnd):
        res.update(method=method, temp=temp, round=rnd, gbps=nbytes / res["seconds"] / 1e9,
                   samples_s=res["rows"] / res["seconds"], resident_before=resident)
        results.append(res)
        print(f"  [{rnd}] {method:<32} {temp:<5} {res['gbps']:6.2f} GB/s {res['samples_s']:>9,.0f} samples/s "
              f"({res['seconds']:.2f} s, {res['rows']} rows, {resident:.0%} of pages cached before, "
              f"reader {res['reader']})", flush=True)

    def cold(paths):
        if dropped:
            drop_caches()
        evict(paths)
        return resident_fraction(paths)

    sf = files_of(store)
    hf_bytes = sum(p.stat().st_size for p in hf_files)
    for rnd in range(args.repeats):  # rounds interleave the methods, so a noisy neighbour hits all of them
        for reader, label in (("uring", "scan io_uring+O_DIRECT"), ("mmap", "scan mmap")):
            record(label, "cold", scan_store(store, reader, args.blocks_per_read), store_bytes, cold(sf), rnd)
            record(label, "warm", scan_store(store, reader, args.blocks_per_read), store_bytes,
                   resident_fraction(sf), rnd)
        if hf is not None:
            record("scan datasets.load_from_disk", "cold", scan_datasets(hf), hf_bytes, cold(hf_files), rnd)
            record("scan datasets.load_from_disk", "warm", scan_datasets(hf), hf_bytes, resident_fraction(hf_files),
                   rnd)
        for reader, label, as_numpy in (("uring", "loader io_uring+O_DIRECT", False), ("mmap", "loader mmap", False),
                                        ("uring", "loader io_uring+O_DIRECT numpy", True)):
            resident = cold(sf)
            res = loader_run(store, reader, args.loader_batches, args.batch_size, as_numpy)
            record(label, "cold", res, res["bytes"], resident, rnd)
        if hf is not None:
            resident = cold(hf_files)
            res = datasets_shuffled(hf, args.loader_batches, args.batch_size)
            record("loader datasets shuffle().iter", "cold", res, res["bytes"], resident, rnd)
    return results


def summarize(results: list[dict], repeats: int) -> list[dict]:
    """Per method and temperature the median, min and max GB/s and the median samples/s over the rounds, printed."""
    print(f"\nmedian of {repeats} round(s) (min-max GB/s):")
    summary = []
    for key in dict.fromkeys((r["method"], r["temp"]) for r in results):
        runs = [r for r in results if (r["method"], r["temp"]) == key]
        g = sorted(r["gbps"] for r in runs)
        row = {"method": key[0], "temp": key[1], "gbps_median": float(np.median(g)), "gbps_min": g[0],
               "gbps_max": g[-1], "samples_s_median": float(np.median([r["samples_s"] for r in runs])),
               "reader": runs[0]["reader"]}
        summary.append(row)
        print(f"  {key[0]:<32} {key[1]:<5} {row['gbps_median']:6.2f} GB/s ({g[0]:.2f}-{g[-1]:.2f}) "
              f"{row['samples_s_median']:>9,.0f} samples/s")
    return summary


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
