"""The process `sandbox.py` starts for one tool call: reads its job (JSON) from stdin, confines itself
(`sandbox_confine.py`: namespaces, a read-only filesystem but its temporary directory, seccomp, Landlock, a process
cap), then runs the tool and writes the outcome (JSON, with the protections that were active) to the job's result
file.

With a PID namespace the process forks the namespace's init, which forks the tool: when the tool's process ends,
or this process dies (PR_SET_PDEATHSIG), init ends and the kernel kills every process left in the namespace,
whatever session or process group it moved to.

Run by file path (`python -I sandbox_child.py`), so it imports only the standard library, `sandbox_confine.py`
(loaded by path) and the tool's own file; it imports nothing of ds_rlhf.
"""

import importlib.util
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import traceback

NO_NETWORK = "network access is disabled in the ds_rlhf tool sandbox"
NO_NETWORK_ENV = "DS_RLHF_SANDBOX_NO_NETWORK"


def _load(path: str, name: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name) if name else module


confine = _load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_confine.py"), "",
                "ds_rlhf_sandbox_confine")


def _limit(job: dict) -> None:
    cpu = int(job["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(job["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    size = int(job["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _python_sockets_refused() -> None:
    def refuse(*_args, **_kwargs):
        raise PermissionError(NO_NETWORK)

    for name in ("connect", "connect_ex", "bind", "sendto"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse
    socket.getaddrinfo = refuse


def _tool_confinement(job: dict, prot: dict, missing: dict) -> None:
    """In the tool's process, before it runs: seccomp, Landlock, the process cap, Python's sockets."""
    off, no_network = set(job["disable"]), job["no_network"]
    every_family = no_network and not prot["net_ns"]
    why = "turned off (Sandbox.disable)" if off & {"seccomp", "unix_sockets"} else \
        confine.seccomp_sockets(every_family)
    prot["seccomp"] = not why
    prot["unix_sockets"] = "blocked" if not why else "open"
    if why:
        missing["unix_sockets"] = f"{why}; Unix sockets on the filesystem are reachable"
    abi, why = (0, "turned off (Sandbox.disable)") if off & {"landlock", "fs_write"} else \
        confine.landlock(job["work"], every_family)
    prot["landlock"] = abi
    if prot["fs_write"] != "tmpdir_only":
        prot["fs_write"] = "tmpdir_only" if abi else "anywhere"
        if not abi:
            missing["fs_write"] = f"{why}; the tool can write wherever the user can"
    if not prot["nproc_limit"]:
        how, why = ("", "turned off (Sandbox.disable)") if "nproc_limit" in off else \
            confine.nproc_limit(int(job["max_processes"]), prot["user_ns"], job["uid"])
        prot["nproc_limit"], prot["nproc_by"] = (int(job["max_processes"]) if how else 0), how
        if how:
            missing.pop("nproc_limit", None)
        else:
            cgroup = "" if "nproc_limit" in off else missing.get("nproc_limit", "no pids cgroup") + "; "
            missing["nproc_limit"] = f"{cgroup}{why}; no cap on the number of processes"
    why = confine.drop_capabilities()
    prot["capabilities"] = "kept" if why else "dropped"
    if why:
        missing["capabilities"] = why
    if no_network:
        prot["network"] = "namespace" if prot["net_ns"] else "seccomp" if prot["seccomp"] else \
            "landlock_tcp" if abi >= 4 else "python"
        os.environ[NO_NETWORK_ENV] = prot["network"]
        _python_sockets_refused()


def _outcome(job: dict) -> dict:
    try:
        if job["mode"] == "code":
            exec(compile(job["code"], "<tool code>", "exec"), {"__name__": "__main__"})  # noqa: S102  the point
            return {"status": "ok", "value": None}
        value = _load(job["file"], job["name"], "ds_rlhf_sandboxed_tool")(**job["kwargs"])
        return {"status": "ok", "value": None if value is None else str(value)}
    except MemoryError:
        return {"status": "memory", "error": "MemoryError"}
    except BaseException as exc:  # noqa: BLE001  anything the tool raises is its outcome
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        status = "process_limit" if isinstance(exc, BlockingIOError) else "error"
        return {"status": status, "error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb[-3:])}


def _tool(job: dict, prot: dict, missing: dict) -> None:
    """Confine this process, run the tool, write the result; never returns."""
    me = os.getpid()
    _tool_confinement(job, prot, missing)
    required = [n for n in job["require"] if n in missing]
    if required:
        out = {"status": "unprotected", "error": "; ".join(f"{n}: {missing[n]}" for n in required)}
    else:
        _limit(job)
        out = _outcome(job)
    if os.getpid() != me:  # a process the tool forked came back here: only the tool's own process reports
        os._exit(0)
    out["protections"], out["unavailable"] = prot, missing
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


def _mounts(job: dict, prot: dict, missing: dict) -> None:
    """In a mount namespace: everything read-only but the call's temporary directory."""
    if not prot["mount_ns"]:
        return
    why = confine.read_only_but(job["work"])
    if why:
        prot["mount_ns"], missing["mount_ns"] = False, why
        return
    prot["fs_write"] = "tmpdir_only"
    os.chdir(job["work"])  # onto the writable bind mount


def _init(job: dict, prot: dict, missing: dict, alive: int, report: int) -> None:
    """PID 1 of the call's namespace: mounts, forks the tool, reaps, and ends when the tool's process ends (the
    kernel then kills the rest of the namespace). Writes the tool's wait status to `report`; never returns."""
    confine.die_with_parent()
    if select.select([alive], [], [], 0)[0]:  # the parent died before PR_SET_PDEATHSIG was set
        os._exit(1)
    _mounts(job, prot, missing)
    if prot["mount_ns"] and not confine.mount_proc():
        missing["proc"] = "a /proc of the PID namespace could not be mounted: the host's processes are listed"
    tool = os.fork()
    if tool == 0:
        os.close(alive)
        os.close(report)
        _tool(job, prot, missing)
    status = 0
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == tool:
            status = wait_status
            break
    os.write(report, struct.pack("i", status))
    os._exit(0)


def _mirror(status: int) -> None:
    """End this process the way the tool's process ended (the host reads CPU-limit kills off the exit status)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if status else 0)


def _namespaces(job: dict, prot: dict, missing: dict) -> list[str]:
    off = set(job["disable"])
    if "fs_write" in off:
        off.add("mount_ns")
    wanted = [n for n in ("pid_ns", "net_ns", "mount_ns") if n not in off and (n != "net_ns" or job["no_network"])]
    entered, why = confine.unshare(wanted)
    prot["user_ns"] = bool(entered)
    for name in ("pid_ns", "net_ns", "mount_ns"):
        prot[name] = name in entered
        if name not in entered and (name != "net_ns" or job["no_network"]):
            missing[name] = "turned off (Sandbox.disable)" if name in off else why
    return entered


def main() -> None:
    job = json.loads(sys.stdin.read())
    confine.die_with_parent()
    if os.getppid() != job["parent_pid"]:  # the host died before PR_SET_PDEATHSIG was set
        os._exit(1)
    job["uid"] = os.getuid()
    prot = {"pid_ns": False, "net_ns": False, "mount_ns": False, "nproc_limit": 0, "nproc_by": "",
            "fs_write": "anywhere", "unix_sockets": "open", "network": "", "seccomp": False, "landlock": 0,
            "kill": "process_scan"}
    missing: dict[str, str] = {}
    if job["cgroup"]:
        try:
            with open(os.path.join(job["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            prot["nproc_limit"], prot["nproc_by"], prot["kill"] = int(job["max_processes"]), "cgroup", "cgroup"
        except OSError as exc:
            missing["nproc_limit"] = f"pids cgroup: {exc.strerror}"
    entered = _namespaces(job, prot, missing)
    if "pid_ns" not in entered:
        _mounts(job, prot, missing)
        _tool(job, prot, missing)
    prot["kill"] = "pid_ns"
    alive_r, alive_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        os.close(report_r)
        _init(job, prot, missing, alive_r, report_w)
    os.close(alive_r)
    os.close(report_w)
    os.waitpid(pid, 0)
    data = os.read(report_r, 4)
    _mirror(struct.unpack("i", data)[0] if len(data) == 4 else 0)


if __name__ == "__main__":
    main()
