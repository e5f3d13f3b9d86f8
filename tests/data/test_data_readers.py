"""The io_uring + O_DIRECT reader (aligned body, plain read of the tail), its fallbacks, and the mmap reader."""

from __future__ import annotations

import os
import random

import pytest
from datahelp import needs_uring

from ds_rlhf.data import readers
from ds_rlhf.data.readers import PAGE, MmapReader, ReaderUnavailable, UringReader, aligned_bytearray, open_reader
from ds_rlhf.data.store import open_store

SIZES = [1, 100, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 123, (1 << 20) + 7, (9 << 20) + 4095]


def _ranges(size: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = [(0, size), (size, 0), (size - 1, 1), (0, 1)]
    for _ in range(40):
        off = rng.randrange(size)
        out.append((off, rng.randrange(min(size - off, 3 << 20) + 1)))
    cuts = sorted(rng.sample(range(1, size), min(30, size - 1))) if size > 1 else []
    bounds = [0] + cuts + [size]
    out += [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]  # contiguous: these get merged into few reads
    return out


def test_aligned_bytearray_is_page_aligned():
    for n in (PAGE, 2 * PAGE, 5 * PAGE + 8, 1 << 22):
        buf = aligned_bytearray(n)
        assert len(buf) == n
        assert readers._address(buf) % PAGE == 0
    with pytest.raises(ValueError):
        aligned_bytearray(PAGE - 1)


@needs_uring
@pytest.mark.parametrize("size", SIZES)
def test_uring_odirect_reads_exact_bytes_for_unaligned_file_sizes(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    r = UringReader(path, max_io=1 << 20)  # small max_io: big ranges become single reads, contiguous ones merge
    try:
        assert r.kind == "io_uring+O_DIRECT", r.note
        assert r.body_end == size - size % PAGE
        ranges = _ranges(size, seed=size)
        for (off, length), buf in zip(ranges, r.read_ranges(ranges)):
            assert buf.to_pybytes() == data[off:off + length], (off, length)
    finally:
        r.close()


@needs_uring
def test_uring_buffered_and_mmap_agree(tmp_path):
    size = 3 * PAGE + 17
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    ranges = _ranges(size, 1)
    for reader in (UringReader(path, direct=False), MmapReader(path)):
        assert reader.kind in ("io_uring", "mmap")
        assert [b.to_pybytes() for b in reader.read_ranges(ranges)] == [data[o:o + n] for o, n in ranges]
        reader.close()


@needs_uring
def test_out_of_range_and_closed_reads_fail_loudly(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 5000)
    r = UringReader(path)
    with pytest.raises(ValueError, match="outside"):
        r.read_ranges([(4000, 2000)])
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.read_ranges([(0, 10)])


@needs_uring
def test_odirect_refused_falls_back_to_buffered_io_uring(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    data = os.urandom(2 * PAGE + 5)
    path.write_bytes(data)
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    r, note = open_reader(path, "auto")
    assert r.kind == "io_uring" and "O_DIRECT refused" in note
    assert r.read_ranges([(PAGE - 3, PAGE + 8)])[0].to_pybytes() == data[PAGE - 3:2 * PAGE + 5]
    r.close()


def test_no_io_uring_falls_back_to_mmap(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc" * 3000)

    def unavailable(*a, **k):
        raise ReaderUnavailable("io_uring_queue_init failed: [Errno 1] Operation not permitted")

    monkeypatch.setattr(readers, "UringReader", unavailable)
    r, note = open_reader(path, "auto")
    assert r.kind == "mmap" and "falling back to mmap" in note
    assert r.read_ranges([(3, 6)])[0].to_pybytes() == b"abcabc"
    r.close()
    with pytest.raises(ReaderUnavailable):
        open_reader(path, "uring")  # an explicit request does not silently degrade


def test_missing_liburing_module_is_reported(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * 10)
    monkeypatch.setitem(sys.modules, "liburing", None)  # makes `import liburing` raise ImportError
    with pytest.raises(ReaderUnavailable, match="liburing"):
        UringReader(path)
    r, note = open_reader(path)
    assert r.kind == "mmap" and "liburing" in note
    r.close()


def test_liburing_that_kills_the_process_falls_back_to_mmap(tmp_path, monkeypatch):
    """The liburing wheel uses AVX-512: on a CPU without it the first call dies with SIGILL (no exception to catch).
    A child process probes it first; a fatal signal there makes io_uring unavailable instead of killing us."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"k" * 10)
    monkeypatch.setattr(readers, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    monkeypatch.setattr(readers, "_probe_result", None)
    r, note = open_reader(path)
    assert r.kind == "mmap" and "SIGILL" in note
    r.close()
    with pytest.raises(ReaderUnavailable, match="crashes on this machine"):
        open_reader(path, "uring")
    monkeypatch.setattr(readers, "_PROBE", "raise SystemExit(1)")  # a Python error: left to the real attempt
    monkeypatch.setattr(readers, "_probe_result", None)
    assert readers._liburing_crash() == ""


def test_env_override_forces_mmap(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"q" * 10)
    monkeypatch.setenv("DS_RLHF_DATA_READER", "mmap")
    r, _ = open_reader(path)
    assert r.kind == "mmap"
    r.close()
    with pytest.raises(ValueError, match="reader must be one of"):
        open_reader(path, "bogus")


@pytest.mark.parametrize("reader", ["uring", "mmap"])
def test_store_rows_identical_across_readers(sft_store, reader):
    from datahelp import synthetic_rows

    if reader == "uring" and not readers_available():
        pytest.skip("io_uring is unavailable on this kernel/sandbox")
    expected = synthetic_rows(300)
    store = open_store(sft_store, reader=reader)
    try:
        assert store.reader_kind == ("io_uring+O_DIRECT" if reader == "uring" else "mmap")
        sizes = [(sft_store / f["name"]).stat().st_size for f in store.manifest["files"]]
        assert len(sizes) == 3 and all(s % PAGE for s in sizes)  # the unaligned tail path is exercised
        idx = list(range(299, -1, -1))
        for got, i in zip(store.rows(idx), idx):
            assert got["input_ids"] == expected[i]["input_ids"] and got["row_id"] == i and got["index"] == i
        assert store.column("row_id").to_pylist() == list(range(300))
        assert store.lengths.tolist() == [len(r["input_ids"]) for r in expected]
    finally:
        store.close()


def readers_available() -> bool:
    from datahelp import uring_works

    return uring_works()


@needs_uring
def test_pooled_buffers_are_reused_only_when_free(tmp_path):
    """Read buffers are recycled, but never while a view (a cached block, a numpy array) still uses them."""
    data = os.urandom(8 * PAGE)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    r = UringReader(path)
    first = r.read_ranges([(0, 2 * PAGE)])[0]
    second = r.read_ranges([(4 * PAGE, 2 * PAGE)])[0]  # same size: must not overwrite `first`
    assert first.to_pybytes() == data[:2 * PAGE] and second.to_pybytes() == data[4 * PAGE:6 * PAGE]
    assert first.address != second.address
    addr = second.address
    del second
    third = r.read_ranges([(2 * PAGE, 2 * PAGE)])[0]
    assert third.address == addr and third.to_pybytes() == data[2 * PAGE:4 * PAGE]  # recycled once free
    assert first.to_pybytes() == data[:2 * PAGE]
    r.close()
