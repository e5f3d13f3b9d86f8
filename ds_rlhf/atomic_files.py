"""The file-system atomics: a file or a directory replaced whole, so a reader (or a crash, or a full disk midway)
sees the previous one or the new one, never half of either.

- ``write_text_atomic``: a file written beside its target, flushed, renamed over it, the directory flushed (status
  files, rewritten logs).
- ``publish_dir`` / ``replace_dir``: a directory written into a temp directory beside the target, flushed to disk,
  then swapped in (``renameat2(RENAME_EXCHANGE)`` where the filesystem has it, two renames otherwise): exports, GGUF
  conversion, run checkpoints and the best checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

_RENAME_EXCHANGE = 2
_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the kernel, libc or filesystem lacks it."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.renameat2  # noqa: B018 (glibc >= 2.28)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    at_fdcwd = -100
    return _libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace the file at ``path`` with ``text``: written beside it (``.<name>.tmp``), fsynced, renamed over it, the
    directory fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and directory under ``root`` to disk (before publishing it by a rename)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put the finished directory ``new`` at ``target``, replacing what is there; at no moment is ``target`` a
    half-written directory. ``new`` and ``target`` must be on one filesystem (siblings)."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.rename(new, target)
    elif _exchange(new, target):  # target now new; new holds the old contents
        shutil.rmtree(new)
    else:  # two renames: between them `target` is absent, never partial
        old = target.with_name(f".old_{target.name}_{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
        os.rename(new, target)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(target.parent)


def publish_dir(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a temp directory beside ``out_dir``, flush it to disk, then swap it in at ``out_dir``
    (``replace_dir``): a crash or a full disk midway leaves the previous ``out_dir`` whole. This process only.

    ``out_dir`` a symlink: the directory it points to is the one replaced (the link stays); a link to something
    other than a directory is refused. The files written get the permissions the umask gives new files (libraries
    that write through a private temp file, such as safetensors, leave 0600)."""
    link = Path(out_dir)
    out = _link_target(link) if link.is_symlink() else link
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".tmp_{out.name}_*"):  # left by an export that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    tmp.mkdir()
    try:
        write(tmp)
        umask_permissions(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return link


def _link_target(link: Path) -> Path:
    target = link.resolve()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the output is a symlink to something other than a directory "
                                                f"({target}); pass a directory", str(link))
    return target


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and set it back at once)
    os.umask(mask)
    return mask


def umask_permissions(root: Path) -> None:
    """Give every regular file under ``root`` the mode a new file gets under the process's umask (0644 under 022),
    keeping its execute bits."""
    mask = _umask()
    mode = 0o666 & ~mask
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, mode | (st.st_mode & 0o111 & ~mask))
