"""The process `sandbox.py` starts for one tool call: reads its job (JSON) from stdin, sets its own resource limits,
disables Python's sockets, then runs the tool and writes the outcome (JSON) to the job's result file.

Run by file path (`python -I sandbox_child.py`), so it imports only the standard library and the tool's own file;
it imports nothing of ds_rlhf.
"""

import importlib.util
import json
import os
import resource
import socket
import sys
import traceback

NO_NETWORK = "network access is disabled in the ds_rlhf tool sandbox"


def _limit(job: dict) -> None:
    cpu = int(job["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(job["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    size = int(job["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def _no_network() -> None:
    def refuse(*_args, **_kwargs):
        raise PermissionError(NO_NETWORK)

    for name in ("connect", "connect_ex", "bind", "sendto"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse
    socket.getaddrinfo = refuse


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
    _limit(job)
    if job["no_network"]:
        _no_network()
    out: dict
    try:
        value = _run(job)
        out = {"status": "ok", "value": None if value is None else str(value)}
    except MemoryError:
        out = {"status": "memory", "error": "MemoryError"}
    except BaseException as exc:  # noqa: BLE001  anything the tool raises is its outcome
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb[-3:])}
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
