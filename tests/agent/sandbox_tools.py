"""Tools that try to get out of the sandbox (module-level functions of this file, standard library only: the
sandbox's process loads this file by path in every call)."""

from __future__ import annotations

import os
import time


def fork_and_setsid(token: str) -> str:
    """Leave processes behind in a session of their own and return at once: a Python one sleeping, and a `sleep`
    program whose command line carries `token` (so the host can look for it in /proc).

    Args:
        token: a number of seconds to sleep, unique to the call
    """
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", token])
        os.write(ready_w, b"x")  # both are out of the tool's session now
        time.sleep(300)
        os._exit(0)
    os.read(ready_r, 1)
    return "returned"


def unix_dial(path: str) -> str:
    """Read a line from a Unix socket on the filesystem, with the C-level socket module.

    Args:
        path: the socket's path
    """
    import _socket

    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s.recv(100).decode()


def write_file(path: str, megabytes: int = 1) -> str:
    """Write megabytes of zeros to a file.

    Args:
        path: where
        megabytes: how many
    """
    with open(path, "wb") as f:
        f.write(bytes(megabytes << 20))
    return "written"


def fork_bomb(catch: bool = True) -> str:
    """Fork children that sleep until the fork fails; the number of children forked (`catch`) or the error.

    Args:
        catch: return the count instead of raising when a fork fails
    """
    children = 0
    try:
        while children < 200:  # past any cap the sandbox sets; harmless on a shared machine if the cap fails
            if os.fork() == 0:
                time.sleep(300)
                os._exit(0)
            children += 1
    except OSError as exc:
        if not catch:
            raise
        return f"{children} {exc.errno}"
    return f"{children} none"
