"""The process `sandbox.py` starts for one tool call: reads its job (JSON) from stdin, cuts itself off the network
(its own user and network namespace where the kernel lets an unprivileged process make one, and Python's sockets
disabled), sets its own resource limits, then runs the tool and writes the outcome (JSON) to the job's result file.

Run by file path (`python -I sandbox_child.py`), so it imports only the standard library and the tool's own file;
it imports nothing of ds_rlhf.
"""

import ctypes
import importlib.util
import json
import os
import resource
import socket
import sys
import traceback

NO_NETWORK = "network access is disabled in the ds_rlhf tool sandbox"
NO_NETWORK_ENV = "DS_RLHF_SANDBOX_NO_NETWORK"
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def _limit(job: dict) -> None:
    cpu = int(job["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(job["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    size = int(job["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def _network_namespace() -> bool:
    """Move this process (and every process it starts) into a new user and network namespace: no interface but
    its own loopback, which is down, so nothing outside is reachable, not even the host's 127.0.0.1. Its user and
    group ids are mapped to themselves in the namespace, so the tool sees the ids it would see outside. False where
    the kernel refuses (not Linux, unprivileged user namespaces disabled, a seccomp policy forbidding unshare)."""
    if not sys.platform.startswith("linux"):
        return False
    uid, gid = os.getuid(), os.getgid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            return False
    except (OSError, AttributeError):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            pass  # the network is cut all the same; only the ids' mapping is missing
    return True


def _no_network() -> str:
    """Cut the network; returns how: "namespace" (a network namespace, and Python's sockets refused) or "python"
    (Python's sockets refused only)."""
    mode = "namespace" if _network_namespace() else "python"
    os.environ[NO_NETWORK_ENV] = mode

    def refuse(*_args, **_kwargs):
        raise PermissionError(NO_NETWORK)

    for name in ("connect", "connect_ex", "bind", "sendto"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse
    socket.getaddrinfo = refuse
    return mode


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location("ds_rlhf_sandboxed_tool", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _run(job: dict):
    if job["mode"] == "code":
        scope = {"__name__": "__main__"}
        exec(compile(job["code"], "<tool code>", "exec"), scope)  # noqa: S102  the point of the sandbox
        return None
    return _load(job["file"], job["name"])(**job["kwargs"])


def main() -> None:
    job = json.loads(sys.stdin.read())
    network = _no_network() if job["no_network"] else ""
    _limit(job)
    out: dict
    try:
        value = _run(job)
        out = {"status": "ok", "value": None if value is None else str(value)}
    except MemoryError:
        out = {"status": "memory", "error": "MemoryError"}
    except BaseException as exc:  # noqa: BLE001  anything the tool raises is its outcome
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb[-3:])}
    out["network"] = network
    sys.stdout.flush()
    sys.stderr.flush()
    limit = int(job["max_output_bytes"])
    for key in ("value", "error", "traceback"):
        if isinstance(out.get(key), str) and len(out[key]) > limit:
            out[key + "_chars"] = len(out[key])
            out[key] = out[key][:limit]
    with open(job["result_path"], "w", encoding="utf-8") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main()
