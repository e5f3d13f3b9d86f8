"""The kernel mechanisms a sandboxed call's process confines itself with (Linux; each one reports whether the kernel
allowed it, none raises): user, PID, network and mount namespaces (`unshare`), a read-only view of every mount but
the call's temporary directory (`mount_setattr`), a fresh `/proc`, a seccomp filter refusing sockets, a Landlock
ruleset confining writes (and, from Landlock ABI 4 / 6, TCP and signals / abstract Unix sockets),
`RLIMIT_NPROC`, and no capabilities.

Standard library only, no ds_rlhf import: `sandbox_child.py` loads this file by path in the sandbox's process.
"""

import contextlib
import ctypes
import errno
import os
import platform
import resource
import struct
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
NAMESPACES = {"mount_ns": CLONE_NEWNS, "pid_ns": CLONE_NEWPID, "net_ns": CLONE_NEWNET}
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
# per architecture: (AUDIT_ARCH, socket); mount_setattr, io_uring_setup and landlock's calls share their numbers
ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
SYS_MOUNT_SETATTR, SYS_IO_URING_SETUP = 442, 425
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 444, 445, 446
AF_UNIX = 1

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


def _arg(a):
    return ctypes.c_long(a) if isinstance(a, int) else a


def _syscall(*args) -> int:
    return _libc.syscall(*map(_arg, args))


def _prctl(*args) -> int:
    return _libc.prctl(*map(_arg, args))


def _why() -> str:
    return os.strerror(ctypes.get_errno())


def unshare(wanted: list[str]) -> tuple[list[str], str]:
    """Enter a new user namespace with as many of `wanted` (names of `NAMESPACES`) as the kernel allows, trying the
    full set first, then dropping the mount, then the PID namespace. Its user and group ids are mapped to themselves,
    so the tool sees the ids it would see outside. Returns (the namespaces entered, why the others were not)."""
    if _libc is None:
        return [], "not Linux"
    tries = [wanted, [n for n in wanted if n != "mount_ns"], [n for n in wanted if n == "net_ns"]]
    why = ""
    for names in dict.fromkeys(tuple(t) for t in tries if t):
        flags = CLONE_NEWUSER
        for name in names:
            flags |= NAMESPACES[name]
        uid, gid = os.getuid(), os.getgid()
        if _libc.unshare(flags) == 0:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                try:
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                except OSError:
                    pass  # the namespaces hold all the same; only the ids' mapping is missing
            left = [n for n in wanted if n not in names]
            return list(names), (f"unshare: {why}" if left and why else "")
        why = _why()
    return [], f"unshare: {why or 'nothing to unshare'}"


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG)."""
    if _libc is not None:
        _prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int, propagation: int) -> bool:
    attr = struct.pack("QQQQ", attr_set, attr_clr, propagation, 0)
    return _syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, attr, len(attr)) == 0


def read_only_but(work: str) -> str:
    """In a new mount namespace: every mount read-only and private except `work` (a writable bind mount of
    itself). Returns "" or why not."""
    if _libc.mount(work.encode(), work.encode(), None, MS_BIND, None) != 0:
        return f"bind mount of the temporary directory: {_why()}"
    if not _mount_setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0, MS_PRIVATE):
        return f"read-only remount: {_why()}"
    if not _mount_setattr(work, 0, 0, MOUNT_ATTR_RDONLY, 0):
        return f"writable temporary directory: {_why()}"
    return ""


def mount_proc() -> bool:
    """A /proc of this PID namespace over the host's (its processes only)."""
    return _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


def _no_new_privs() -> bool:
    return _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def seccomp_sockets(every_family: bool) -> str:
    """Install a seccomp filter: `socket(AF_UNIX, ...)` fails with EACCES (every family with `every_family`), so
    are `io_uring_setup` (its rings can open sockets) and any call of another ABI (32-bit, x32). `socketpair` stays:
    its two ends reach nothing else. Returns "" or why not."""
    arch = ARCHES.get(platform.machine())
    if _libc is None or arch is None:
        return f"seccomp: no filter for {sys.platform} {platform.machine()}"
    audit_arch, sys_socket = arch
    deny, allow = 0x00050000 | errno.EACCES, 0x7FFF0000
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, 0x00050000 | errno.EPERM),
            (ld, 0, 0, 0), (jge, 5, 0, 0x40000000), (jeq, 4, 0, SYS_IO_URING_SETUP), (jeq, 0, 2, sys_socket)]
    prog += [(ret, 0, 0, deny), (ret, 0, 0, deny)] if every_family else [(ld, 0, 0, 16), (jeq, 1, 0, AF_UNIX)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    code = b"".join(struct.pack("HBBI", *insn) for insn in prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    if not _no_new_privs() or _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        return f"seccomp: {_why()}"
    return ""


def landlock_abi() -> int:
    return max(int(_syscall(SYS_LANDLOCK_CREATE, None, 0, 1)), 0) if _libc is not None else 0


def landlock(work: str, block_tcp: bool) -> tuple[int, str]:
    """Confine writes (making, removing, renaming, writing, truncating files) to `work` and the harmless devices,
    for this process and every process it starts; with ABI >= 4 and `block_tcp` TCP connect / bind are refused,
    with ABI >= 6 signals to processes outside the sandbox and abstract Unix sockets are too (ptrace of an outside
    process is refused from ABI 1). Returns (the ABI used, 0 = none; why not)."""
    abi = landlock_abi()
    if abi < 1:
        return 0, "landlock: not available in this kernel"
    write = 0b1_1111_1111_0010  # WRITE_FILE, REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
    net = 0b11 if abi >= 4 and block_tcp else 0
    scoped = 0b11 if abi >= 6 else 0
    attr = struct.pack("QQQ", write, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _syscall(SYS_LANDLOCK_CREATE, attr, len(attr), 0)
    if ruleset < 0:
        return 0, f"landlock: {_why()}"
    try:
        file_rights = write & ((1 << 1) | (1 << 14))
        rules = [(work, write)] + [(p, file_rights) for p in ("/dev/null", "/dev/zero", "/dev/full")]
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rule = struct.pack("=Qi", rights, fd)
                if _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0) != 0:
                    return 0, f"landlock rule for {path}: {_why()}"
            finally:
                os.close(fd)
        if not _no_new_privs() or _syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0) != 0:
            return 0, f"landlock: {_why()}"
    finally:
        os.close(ruleset)
    return abi, ""


def drop_capabilities() -> str:
    """Drop every capability of this process (effective, permitted, inheritable, ambient) and empty its bounding
    set, so no program it starts gets one back (root's included). Returns "" or why not."""
    nr = SYS_CAPSET.get(platform.machine())
    if _libc is None or nr is None:
        return f"capabilities: not handled on {sys.platform} {platform.machine()}"
    for cap in range(64):
        if _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows (EPERM: none to drop without CAP_SETPCAP)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if _syscall(nr, struct.pack("Ii", 0x20080522, 0), bytes(24)) != 0:  # capset, version 3: all zero
        return f"capset: {_why()}"
    return ""


def user_processes(uid: int) -> int:
    """How many processes of `uid` this process can see."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                count += os.stat(f"/proc/{entry}").st_uid == uid
    return count


def nproc_limit(limit: int, own_user_ns: bool, outer_uid: int) -> tuple[str, str]:
    """Cap the processes this one may start with RLIMIT_NPROC. In a user namespace of its own the kernel counts
    the namespace's processes only; outside one it counts every process of the user, so the cap is set at the
    user's current count plus `limit`. Root (uid 0 outside) is exempt from RLIMIT_NPROC. Returns (how: "rlimit",
    "rlimit_shared" or ""; why not)."""
    if outer_uid == 0:
        return "", "RLIMIT_NPROC: the kernel does not apply it to root"
    cap = limit if own_user_ns else user_processes(outer_uid) + limit
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    except (ValueError, OSError) as exc:
        return "", f"RLIMIT_NPROC: {exc}"
    return ("rlimit" if own_user_ns else "rlimit_shared"), ""
