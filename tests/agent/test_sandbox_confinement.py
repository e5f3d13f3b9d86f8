"""What the tool sandbox holds against a tool that tries to get out: processes left behind in a session of their
own (none survives the call, nor the run), a fork bomb (capped), a Unix socket of the host (refused), a write
outside the call's temporary directory (refused, nothing written); each result lists the protections that were
active. Where this kernel refuses a namespace, the fallbacks and their warnings."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import sandbox_tools as t

from ds_rlhf.agent import sandbox_reap
from ds_rlhf.agent.sandbox import PROTECTIONS, Sandbox, SandboxUnprotected, require_protections
from ds_rlhf.config import Config, ConfigError, help_text, parse_config
from ds_rlhf.recipes.rl import RLTrainer
from tests.agent.test_rl_episodes import episode_args

ROOT = Path(__file__).resolve().parents[2]
KILL_MODES = {"pid_ns": (), "cgroup": ("pid_ns",), "process_scan": ("pid_ns", "cgroup")}


def checked(sandbox: Sandbox, fn=None, **kwargs):
    """One call (`run_code(kwargs["code"])` without `fn`); each protection the result lists as unavailable (the
    kernel refused it, or `disable` turned it off) came with its warning, and no other warning came."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = sandbox.call(fn, kwargs) if fn is not None else sandbox.run_code(kwargs["code"])
    said = {str(w.message).split(" (")[0].removeprefix("tool sandbox: no ") for w in caught
            if issubclass(w.category, RuntimeWarning)}
    assert said == set(result.unavailable), (said, result.unavailable)
    assert set(sandbox.disable) & set(PROTECTIONS) <= set(result.unavailable)
    return result


def needs(result, name: str) -> None:
    """Skip where this kernel refuses `name` (the warning was asserted by `checked`)."""
    if name in result.unavailable:
        pytest.skip(f"this kernel refuses {name}: {result.unavailable[name]}")


def token() -> str:
    return f"{random.randint(300, 399)}.{random.randint(10**8, 10**9)}"  # seconds to sleep, unique


def survivors(tok: str) -> list[int]:
    """The processes of this test process's sandboxed calls still alive: carrying the call marker of this
    process, or running a program whose command line holds `tok`."""
    found = set(sandbox_reap.marked_processes(f"{os.getpid()}-"))
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if tok.encode() in f.read().split(b"\0"):
                    found.add(int(entry))
        except (OSError, ValueError):
            pass
    return sorted(found)


def no_survivors(tok: str) -> bool:
    """True once nothing of the call is left (a killed process needs a moment to be reaped)."""
    for _ in range(100):
        if not survivors(tok):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("kill", list(KILL_MODES))
def test_processes_left_in_their_own_session_are_killed_when_the_call_returns(kill):
    if kill == "cgroup" and sandbox_reap._pids_cgroup_base() is None:
        pytest.skip("no writable pids cgroup for this user here")
    tok = token()
    result = checked(Sandbox(timeout_s=60, disable=KILL_MODES[kill]), t.fork_and_setsid, token=tok)
    assert result.ok and result.value == "returned", result  # returned at once: not a timeout
    assert no_survivors(tok), (result, survivors(tok))  # whichever way the kernel allowed (`kill`)
    if kill == "pid_ns":
        needs(result, "pid_ns")
    assert result.protections["kill"] == kill, result


def detached_sleep(tok: str) -> str:
    """Tool code that leaves a `sleep tok` in a session of its own, then hangs."""
    return textwrap.dedent(f"""
        import os, time
        ready_r, ready_w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{tok}"])
            os.write(ready_w, b"x")
            time.sleep(600)
        os.read(ready_r, 1)
        print("detached", flush=True)
        time.sleep(600)
    """)


def wait_for(tok: str) -> bool:
    for _ in range(1200):
        if survivors(tok):
            return True
        time.sleep(0.05)
    return False


def test_a_hanging_call_is_killed_whole_at_its_deadline_and_when_the_run_stops():
    tok = token()
    late = Sandbox(timeout_s=2).run_code(detached_sleep(tok))
    assert late.status == "timeout" and no_survivors(tok), late
    tok = token()
    done = []
    worker = threading.Thread(target=lambda: done.append(Sandbox(timeout_s=300).run_code(detached_sleep(tok))))
    worker.start()
    assert wait_for(tok), "the call did not start"
    assert sandbox_reap.stop_all() == 1
    worker.join(60)
    assert done and done[0].status == "killed" and no_survivors(tok), done


def test_the_run_exiting_kills_the_calls_in_flight():
    tok = token()
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        from ds_rlhf.agent.sandbox import Sandbox
        threading.Thread(target=Sandbox(timeout_s=300).run_code, args=({detached_sleep(tok)!r},), daemon=True).start()
        while not any({tok!r}.encode() in open(f"/proc/{{p}}/cmdline", "rb").read() for p in os.listdir("/proc")
                      if p.isdigit() and os.path.exists(f"/proc/{{p}}/cmdline")):
            time.sleep(0.05)
        print("started", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "started", done.stderr[-3000:]
    assert no_survivors(tok), survivors(tok)


def test_a_fork_bomb_is_capped_at_the_process_limit():
    caught = checked(Sandbox(timeout_s=60, max_processes=12), t.fork_bomb)
    needs(caught, "nproc_limit")
    children, err = caught.value.split()
    assert caught.protections["nproc_limit"] == 12 and int(children) < 12 and err == "11", caught
    raised = Sandbox(timeout_s=60, max_processes=12).call(t.fork_bomb, {"catch": False})
    assert raised.status == "process_limit" and "limit of 12 processes" in raised.observation("fork_bomb"), raised


@pytest.fixture()
def host_socket(tmp_path):
    """A Unix socket server on the host's filesystem answering "hello from the host": its path."""
    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"hello from the host")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join()
    server.close()


def test_a_unix_socket_of_the_host_is_refused(host_socket):
    assert checked(Sandbox(disable=("unix_sockets",)), t.unix_dial, path=host_socket).value == "hello from the host"
    result = checked(Sandbox(), t.unix_dial, path=host_socket)
    needs(result, "unix_sockets")
    assert result.status == "error" and "PermissionError" in result.error, result
    assert result.protections["unix_sockets"] == "blocked"


@pytest.mark.parametrize("disable", [(), ("mount_ns",)], ids=["mount_ns", "landlock"])
def test_a_write_outside_the_temporary_directory_is_refused(tmp_path, disable):
    outside = tmp_path / "escaped.bin"
    result = checked(Sandbox(disable=disable), t.write_file, path=str(outside))
    needs(result, "fs_write")
    assert result.status == "error" and not outside.exists(), result
    assert result.protections["fs_write"] == "tmpdir_only"
    inside = checked(Sandbox(), code="open('in.bin', 'wb').write(b'x'); import os; print(os.path.getsize('in.bin'))")
    assert inside.ok and inside.output.strip() == "1", inside


@pytest.mark.parametrize("disable", [(), ("pid_ns",)], ids=["pid_ns", "landlock"])
def test_the_tool_cannot_signal_the_trainer(disable):
    code = f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('sent')\nexcept OSError as e:\n" \
           "    print(e.errno)"
    result = checked(Sandbox(disable=disable), code=code)
    if not result.protections["pid_ns"] and result.protections["landlock"] < 6:
        pytest.skip("this kernel gives neither a PID namespace nor Landlock ABI 6 (signal scoping)")
    assert result.output.strip() in ("1", "3"), result  # EPERM (Landlock) or ESRCH (not in the PID namespace)


def test_the_result_lists_the_protections():
    result = checked(Sandbox(), code="pass")
    p = result.protections
    assert set(p) >= {"pid_ns", "net_ns", "mount_ns", "nproc_limit", "fs_write", "unix_sockets", "network", "kill"}
    assert p["pid_ns"] == (p["kill"] == "pid_ns") and p["network"] == result.network
    assert set(result.unavailable) <= set(p) | {"proc"}
    bare = checked(Sandbox(disable=("landlock", "seccomp", "mount_ns")), code="pass")
    assert not bare.protections["seccomp"] and bare.protections["fs_write"] == "anywhere"
    assert {"fs_write", "mount_ns", "unix_sockets"} <= set(bare.unavailable)


REFUSED = textwrap.dedent("""
    # this process and its children may not unshare (a seccomp filter: EPERM), as on a kernel without user
    # namespaces for unprivileged users; then the sandbox's fallbacks
    import ctypes, errno, json, os, platform, struct, sys, threading, time, warnings
    sys.path.insert(0, sys.argv[1])
    import sandbox_tools
    from ds_rlhf.agent.sandbox import Sandbox, SandboxUnprotected
    if platform.machine() not in ("x86_64", "aarch64"):
        print(json.dumps({"skip": f"no seccomp filter written for {platform.machine()}"}))
        sys.exit(0)
    audit_arch, unshare = {"x86_64": (0xC000003E, 272), "aarch64": (0xC00000B7, 97)}[platform.machine()]
    prog = [(0x20, 0, 0, 4), (0x15, 0, 3, audit_arch), (0x20, 0, 0, 0), (0x15, 0, 1, unshare),
            (0x06, 0, 0, 0x00050000 | errno.EPERM), (0x06, 0, 0, 0x7FFF0000)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    libc = ctypes.CDLL(None, use_errno=True)
    L = ctypes.c_ulong
    if libc.prctl(38, L(1), L(0), L(0), L(0)) or \
            libc.prctl(22, L(2), struct.pack("HxxxxxxP", len(prog), ctypes.addressof(code)), L(0), L(0)):
        print(json.dumps({"skip": "this kernel refuses a seccomp filter: " + os.strerror(ctypes.get_errno())}))
        sys.exit(0)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = Sandbox(timeout_s=60).call(sandbox_tools.fork_and_setsid, {"token": sys.argv[2]})
        out["call"] = [r.status, r.value, r.protections, r.unavailable, r.network]
        w = Sandbox(timeout_s=60).call(sandbox_tools.write_file, {"path": sys.argv[3]})
        out["write"] = [w.status, w.error]
        b = Sandbox(timeout_s=60, max_processes=12).call(sandbox_tools.fork_bomb, {})
        out["bomb"] = [b.value, b.protections["nproc_limit"]]
    out["warnings"] = [str(c.message) for c in caught]
    try:
        Sandbox(require="strict").run_code("pass")
        out["strict"] = "ran"
    except SandboxUnprotected as exc:
        out["strict"] = str(exc)
    print(json.dumps(out), flush=True)
""")


def test_where_the_kernel_refuses_namespaces_the_fallbacks_hold_and_warn(tmp_path):
    tok, outside = token(), tmp_path / "escaped.bin"
    done = subprocess.run([sys.executable, "-c", REFUSED, str(Path(__file__).parent), tok, str(outside)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    status, value, prot, unavailable, network = out["call"]
    assert status == "ok" and value == "returned" and no_survivors(tok), (out, survivors(tok))
    assert not prot["pid_ns"] and not prot["net_ns"] and not prot["mount_ns"] and prot["kill"] != "pid_ns"
    assert "Operation not permitted" in unavailable["pid_ns"]
    for name in ("pid_ns", "net_ns", "mount_ns"):
        assert any(w.startswith(f"tool sandbox: no {name} (unshare: Operation not permitted") for w in out["warnings"])
    assert prot["unix_sockets"] == "blocked" and network == "seccomp"  # every socket() refused instead
    if prot["landlock"]:
        assert prot["fs_write"] == "tmpdir_only" and out["write"][0] == "error" and not outside.exists(), out
    else:
        assert prot["fs_write"] == "anywhere" and "fs_write" in unavailable
    children, limit = out["bomb"]
    if limit:
        assert int(children.split()[0]) < 12, out
    assert out["strict"].startswith("the tool sandbox cannot give the required protections here: pid_ns: unshare")


def test_required_protections_are_checked_at_once():
    assert require_protections("") == ()
    try:
        assert require_protections("strict") == ("pid_ns", "net_ns", "mount_ns", "nproc_limit", "fs_write",
                                                 "unix_sockets")
        with pytest.raises(SandboxUnprotected, match="unix_sockets: turned off"):
            Sandbox(disable=("unix_sockets",)).run_code("pass")
        assert Sandbox(require=()).run_code("pass").ok
    finally:
        require_protections("")
    with pytest.raises(ConfigError, match="sandbox protection 'network' is not one of"):
        require_protections("network")
    with pytest.raises(ConfigError, match="Sandbox.disable: 'pid_namespace' is not one of"):
        Sandbox(disable=("pid_namespace",)).run_code("pass")


def test_rl_sandbox_require_is_checked_before_any_model_loads(tiny_model_path, arithmetic_store, dist_single,
                                                               tmp_path):
    assert "--env.sandbox_require ''" in help_text(Config())
    args = episode_args(tiny_model_path, arithmetic_store, tmp_path / "run", 1)
    with pytest.raises(ConfigError, match="sandbox protection 'everything' is not one of pid_ns"):
        RLTrainer(parse_config([*args, "--env.sandbox_require", "everything"]))
    require_protections("")
