"""Block readers for store files: io_uring with O_DIRECT where the kernel allows it, memory-mapping otherwise.

Why io_uring + O_DIRECT: a training job reads its data once per epoch while the page cache is better spent on
model files and the rollout engine; O_DIRECT bypasses the cache and io_uring keeps many large reads in flight from
one thread, so the prefetch thread, not the trainer, waits for the disk.

O_DIRECT needs the file offset, the length and the memory address to be aligned (4096 covers every logical block
size we meet). So each read covers the *aligned body* around the wanted bytes, and the bytes past the file's last
full page (the unaligned tail) come from a normal ``pread``. The `liburing` binding only accepts ``bytearray``
buffers, and a bytearray's memory is not page-aligned; CPython drops bytes from the front of a bytearray by moving
its start pointer (no copy), so we over-allocate by one page and trim to the next page boundary, then check.

Every reader returns zero-copy ``pyarrow.Buffer`` views of the requested (offset, length) ranges.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import select
import signal
import subprocess
import sys
import threading

import pyarrow as pa

log = logging.getLogger("ds_rlhf.data")

PAGE = 4096
READER_CHOICES = ("auto", "uring", "uring_buffered", "mmap")


class ReaderUnavailable(RuntimeError):
    """The requested reader cannot work here (no io_uring, no liburing, ...); `auto` then falls back to mmap."""


_PROBE = """
import os, sys, liburing
ring, cqe = liburing.Ring(), liburing.Cqe()
liburing.io_uring_queue_init(2, ring)
fd = os.open(sys.executable, os.O_RDONLY)
buf = bytearray(64)
sqe = liburing.io_uring_get_sqe(ring)
liburing.io_uring_prep_read(sqe, fd, buf, 0)
liburing.io_uring_submit(ring)
liburing.io_uring_wait_cqe(ring, cqe)
liburing.io_uring_cqe_seen(ring, cqe[0])
liburing.io_uring_queue_exit(ring)
"""
_probe_result: str | None = None


def _liburing_crash() -> str:
    """Why using liburing would kill this process ("" when it would not); probed once, in a child process.

    The liburing wheel is compiled for newer x86 CPUs (it uses AVX-512 instructions), so on a CPU without them
    its first call dies with SIGILL, which no try/except can catch. A child tries a tiny read first; a Python
    error there (io_uring disabled, ...) is left for the real attempt to report, only a fatal signal counts.
    """
    global _probe_result
    if _probe_result is None:
        try:
            proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=60)
            rc = proc.returncode
            _probe_result = ""
            if rc < 0:
                try:
                    name = signal.Signals(-rc).name
                except ValueError:
                    name = f"signal {-rc}"
                _probe_result = f"the liburing package crashes on this machine ({name}; its wheel may need " \
                                f"CPU features this CPU lacks, e.g. AVX-512)"
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probe_result = f"the liburing probe failed ({exc})"
    return _probe_result


def _address(buf: bytearray) -> int:
    view = ctypes.c_char.from_buffer(buf)  # a temporary export; released when `view` dies below
    addr = ctypes.addressof(view)
    del view
    return addr


def aligned_bytearray(n: int, align: int = PAGE) -> bytearray:
    """A bytearray of exactly `n` bytes (n >= align) whose data starts on an `align` boundary."""
    if n < align:
        raise ValueError(f"aligned buffers must be at least {align} bytes, got {n}")
    buf = bytearray(n + align)
    skip = (-_address(buf)) % align
    if skip:
        del buf[:skip]  # moves the start pointer; no reallocation
    del buf[n:]  # a minor shrink (n >= half the allocation): CPython keeps the memory in place
    if _address(buf) % align:
        raise ReaderUnavailable("could not allocate an aligned bytearray (CPython reallocated it)")
    return buf


class _BufferPool:
    """Reuses aligned read buffers once nothing refers to them any more.

    Fresh memory costs a page fault and a kernel zero-fill per 4 KiB page on first touch, which on a small VM is
    about as slow as the disk; reusing buffers keeps io_uring near raw O_DIRECT speed. A buffer is free when its
    only references are the pool's own: every pyarrow/numpy view of it holds a buffer export, which keeps a
    reference to the bytearray, so a buffer still in use (e.g. a cached block) is never handed out again.
    """

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.total = 0
        self._free: dict[int, list[bytearray]] = {}

    def get(self, n: int) -> bytearray:
        for buf in self._free.get(n, ()):
            if sys.getrefcount(buf) <= 3:  # the pool's list, `buf`, getrefcount's argument
                return buf
        buf = aligned_bytearray(n)
        if self.total + n <= self.limit:
            self._free.setdefault(n, []).append(buf)
            self.total += n
        return buf


class MmapReader:
    """Memory-mapped reads: zero-copy, served by the page cache; works on any filesystem and kernel.

    Each read_ranges call advises the kernel that the requested span is needed soon (MADV_WILLNEED), so the
    pages are read ahead asynchronously in large requests instead of one page fault at a time; the loader's
    prefetch thread calls it ahead of consumption, which makes the page-ins overlap with training.
    """

    kind = "mmap"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fh = open(self.path, "rb")  # noqa: SIM115 - lives as long as the reader
        self.size = os.fstat(self._fh.fileno()).st_size
        self._map = mmap.mmap(self._fh.fileno(), 0, prot=mmap.PROT_READ) if self.size else None
        self._whole = pa.py_buffer(self._map) if self._map is not None else pa.py_buffer(b"")

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[pa.Buffer]:
        if self._whole is None:
            raise ValueError(f"{self.path}: reader is closed")
        for offset, length in ranges:
            if offset < 0 or length < 0 or offset + length > self.size:
                raise ValueError(f"{self.path}: range ({offset}, {length}) outside a {self.size}-byte file")
        if self._map is not None and ranges:
            lo = min(o for o, _ in ranges)
            hi = max(o + n for o, n in ranges)
            lo -= lo % mmap.PAGESIZE
            if hi > lo:
                self._map.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
        return [self._whole.slice(offset, length) for offset, length in ranges]

    def close(self) -> None:
        self._whole = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # views still alive: the mapping goes when they do
                self._map.close()
        self._fh.close()


class UringReader:
    """io_uring reads of whole blocks, many in flight; O_DIRECT with aligned buffers when `direct`.

    Adjacent ranges are merged into reads of up to `max_io` bytes (2 MiB x 32 in flight measured best on our
    virtio disk: see docs/PERFORMANCE.md), so a sequential scan keeps the device busy with large requests.
    One reader serves one file; a lock makes it safe to share between the prefetch thread and the main thread.
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool = True, queue_depth: int = 32,
                 max_io: int = 2 << 20, pool_bytes: int = 256 << 20):
        try:
            import liburing
        except Exception as exc:  # noqa: BLE001 - any import failure means "no io_uring here"
            raise ReaderUnavailable(f"the liburing package cannot be imported ({exc})") from exc
        crash = _liburing_crash()
        if crash:
            raise ReaderUnavailable(crash)
        self._L = liburing
        self.path = str(path)
        self.size = os.path.getsize(self.path)
        self.body_end = self.size - self.size % PAGE  # O_DIRECT may read up to here; the rest is the tail
        self.queue_depth = queue_depth
        self.max_io = max(PAGE, max_io - max_io % PAGE)
        self.note = ""
        self._lock = threading.Lock()
        self._pool = _BufferPool(pool_bytes)
        self._ring = liburing.Ring()
        self._cqe = liburing.Cqe()
        try:
            liburing.io_uring_queue_init(queue_depth, self._ring)
        except OSError as exc:
            raise ReaderUnavailable(f"io_uring_queue_init failed: {exc} (io_uring disabled or unsupported)") from exc
        self._open = True
        self._poller = select.poll()
        self._poller.register(self._ring.ring_fd, select.POLLIN)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._dfd = None
        if direct:
            self._dfd = self._open_direct()
        self.kind = "io_uring+O_DIRECT" if self._dfd is not None else "io_uring"

    def _open_direct(self) -> int | None:
        """Open with O_DIRECT and prove it with one aligned read; None (and a note) when the filesystem refuses."""
        try:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            self.note = f"O_DIRECT refused by the filesystem ({exc.strerror}); using buffered io_uring reads"
            return None
        if self.body_end:
            try:
                self._submit_and_wait([(dfd, aligned_bytearray(PAGE), 0)])
            except OSError as exc:
                os.close(dfd)
                self.note = f"O_DIRECT read failed ({exc.strerror}); using buffered io_uring reads"
                return None
        return dfd

    # -- io_uring plumbing ---------------------------------------------------------------------------------
    def _wait_cqe(self) -> None:
        """Wait for a completion without holding the GIL.

        The binding's io_uring_wait_cqe keeps the GIL while it blocks, which would freeze the trainer thread
        whenever the prefetch thread waits for the disk. So peek (non-blocking) and, when nothing is ready,
        poll(2) the ring's fd (readable when completions are pending); select.poll releases the GIL.
        """
        while True:
            try:
                self._L.io_uring_peek_cqe(self._ring, self._cqe)
                return
            except (BlockingIOError, InterruptedError):
                self._poller.poll(1000)

    def _submit_and_wait(self, reads: list[tuple[int, bytearray, int]]) -> list[int]:
        """Read each (fd, buffer, offset) fully; at most `queue_depth` in flight. Returns bytes read per entry."""
        L = self._L
        done = [0] * len(reads)
        pending = list(range(len(reads)))[::-1]
        inflight = 0
        error: OSError | None = None
        while (pending and error is None) or inflight:
            while pending and error is None and inflight < self.queue_depth:
                i = pending.pop()
                fd, buf, offset = reads[i]
                sqe = L.io_uring_get_sqe(self._ring)
                if sqe is None:
                    pending.append(i)
                    break
                L.io_uring_prep_read(sqe, fd, buf, offset)
                sqe.user_data = i
                inflight += 1
            L.io_uring_submit(self._ring)
            self._wait_cqe()
            entry = self._cqe[0]
            i = entry.user_data
            try:
                done[i] = entry.res  # raises OSError for a negative result
            except OSError as exc:
                error = error or exc
            finally:
                L.io_uring_cqe_seen(self._ring, entry)
                inflight -= 1
        if error is not None:
            raise error
        for i, (_, buf, offset) in enumerate(reads):
            if done[i] < len(buf):  # short read (rare before EOF): finish it with a plain pread on the cached fd
                view = memoryview(buf)[done[i]:]
                got = os.preadv(self._fd, [view], offset + done[i])
                view.release()
                done[i] += got
                if done[i] < len(buf):
                    raise OSError(errno.EIO, f"{self.path}: short read at {offset} ({done[i]} < {len(buf)} bytes)")
        return done

    # -- public ---------------------------------------------------------------------------------------------
    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[pa.Buffer]:
        if not ranges:
            return []
        for offset, length in ranges:
            if offset < 0 or length < 0 or offset + length > self.size:
                raise ValueError(f"{self.path}: range ({offset}, {length}) outside a {self.size}-byte file")
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        groups: list[list] = []  # [lo, hi, [range indices]]: ranges served by one read
        for i in order:
            lo, hi = self._span(*ranges[i])
            if groups and lo <= groups[-1][1] and max(hi, groups[-1][1]) - groups[-1][0] <= self.max_io:
                groups[-1][1] = max(groups[-1][1], hi)
                groups[-1][2].append(i)
            else:
                groups.append([lo, hi, [i]])
        with self._lock:
            if not self._open:
                raise ValueError(f"{self.path}: reader is closed")
            return self._read_groups(ranges, groups)

    def _span(self, offset: int, length: int) -> tuple[int, int]:
        """The bytes actually read for a range: page-aligned for O_DIRECT, exact otherwise."""
        if self._dfd is None:
            return offset, offset + length
        return offset - offset % PAGE, offset + length

    def _read_groups(self, ranges, groups) -> list[pa.Buffer]:
        reads, plans = [], []
        for lo, hi, group in groups:
            if self._dfd is None:
                buf = bytearray(hi - lo)
                reads.append((self._fd, buf, lo))
                plans.append((group, lo, buf, b""))
                continue
            body_hi = min(-(-hi // PAGE) * PAGE, self.body_end)  # aligned end, never past the aligned body
            tail = os.pread(self._fd, hi - body_hi, body_hi) if hi > body_hi else b""  # the unaligned tail
            if body_hi > lo:  # a group with a tail is extended below, so it cannot use a pooled buffer
                buf = aligned_bytearray(body_hi - lo) if tail else self._pool.get(body_hi - lo)
                reads.append((self._dfd, buf, lo))
            else:
                buf = bytearray()
            plans.append((group, lo, buf, tail))
        self._submit_and_wait(reads)
        out: list[pa.Buffer | None] = [None] * len(ranges)
        for group, lo, buf, tail in plans:
            if tail:
                buf.extend(tail)  # copies once, only for the group that touches the end of the file
            whole = pa.py_buffer(buf)
            for i in group:
                offset, length = ranges[i]
                out[i] = whole.slice(offset - lo, length)
        return out

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._L.io_uring_queue_exit(self._ring)
            os.close(self._fd)
            if self._dfd is not None:
                os.close(self._dfd)

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn liburing down already
            self.close()


def open_reader(path: str | os.PathLike, reader: str = "auto"):
    """Pick a reader for one file. `auto` tries io_uring+O_DIRECT, then buffered io_uring, then mmap.

    `DS_RLHF_DATA_READER` overrides `auto` (e.g. to force mmap on a machine where io_uring misbehaves).
    Returns (reader, note) where note says why a fallback happened ("" when none did).
    """
    if reader == "auto":
        reader = os.environ.get("DS_RLHF_DATA_READER", "auto")
    if reader not in READER_CHOICES:
        raise ValueError(f"reader must be one of {READER_CHOICES}, got {reader!r}")
    if reader == "mmap":
        return MmapReader(path), ""
    try:
        r = UringReader(path, direct=reader != "uring_buffered")
        return r, r.note
    except ReaderUnavailable as exc:
        if reader != "auto":
            raise
        note = f"io_uring unavailable ({exc}); falling back to mmap"
        log.info("%s: %s", path, note)
        return MmapReader(path), note
