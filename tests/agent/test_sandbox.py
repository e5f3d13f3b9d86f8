"""The tool sandbox: each call in its own process, cut off at its wall timeout, CPU-time and memory limits, output
truncated, a minimal environment, the network cut (a network namespace where the kernel allows it, Python sockets
refused always); every failure is a result with an observation, never an exception."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import agent_helpers as h
import pytest

from ds_rlhf.agent.sandbox import Sandbox, tool_location
from ds_rlhf.config import ConfigError


def test_call_returns_value_and_output():
    result = Sandbox().call(h.add, {"a": 2, "b": 40})
    assert result.ok and result.value == "42" and result.observation("add") == "42"
    code = Sandbox().run_code("import os\nprint(sum(range(10)))\nprint(os.getcwd())")
    assert code.ok and code.output.splitlines()[0] == "45" and "ds_rlhf_tool_" in code.output


def test_hanging_tool_is_killed_at_its_timeout():
    t0 = time.monotonic()
    result = Sandbox(timeout_s=1.0).call(h.hang, {})
    elapsed = time.monotonic() - t0
    assert result.status == "timeout" and result.seconds >= 1.0 and elapsed < 1.0 + 10
    assert "1 s wall timeout" in result.observation("hang")
    assert result.report("hang")["status"] == "timeout"


def test_raising_tool_is_reported():
    result = Sandbox().call(h.boom, {"message": "no luck"})
    assert result.status == "error" and result.error == "RuntimeError: no luck"
    assert "[tool boom failed: RuntimeError: no luck]" in result.observation("boom")


def test_huge_output_is_truncated():
    result = Sandbox(max_output_bytes=1000).call(h.spam, {"megabytes": 4})
    assert result.ok and len(result.output) == 1000 and result.value == "printed"
    assert result.dropped_bytes == (4 << 20) + 1 - 1000  # the rest of the line and its newline
    assert f"{result.dropped_bytes} more bytes were dropped" in result.observation("spam")


def test_cpu_and_memory_limits():
    cpu = Sandbox(timeout_s=20, cpu_seconds=1).call(h.burn, {})
    assert cpu.status == "cpu_limit" and cpu.seconds < 10, cpu
    mem = Sandbox(memory_mb=512).call(h.eat, {})
    assert mem.status == "memory" and "512 MiB" in mem.observation("eat")


NET_TOOLS = '''
import json
import os
import subprocess
import sys


def raw_dial(port: int) -> str:
    """Connect with the C-level socket, under Python's socket module.

    Args:
        port: the port on 127.0.0.1
    """
    import _socket

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(("127.0.0.1", port))
    return "connected"


def child_fetch(port: int) -> str:
    """Fetch a URL from another Python program.

    Args:
        port: the port on 127.0.0.1
    """
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=3).status)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    return f"rc={done.returncode} out={done.stdout.strip()} err={(done.stderr.strip().splitlines() or [''])[-1]}"


def environment() -> str:
    """The process's environment variables."""
    return json.dumps(dict(os.environ))
'''


@pytest.fixture(scope="module")
def net_tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("net_tools") / "net_tools.py"
    path.write_text(NET_TOOLS)
    spec = importlib.util.spec_from_file_location("net_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def listener():
    """An HTTP server on 127.0.0.1 in this process's network namespace: its port."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_child_gets_a_minimal_environment(net_tools, monkeypatch):
    monkeypatch.setenv("DS_RLHF_TEST_SECRET", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    result = Sandbox().call(net_tools.environment, {})
    env = json.loads(result.value)
    assert "DS_RLHF_TEST_SECRET" not in env and "hunter2" not in result.value and "PYTHONPATH" not in env
    assert set(env) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONIOENCODING", "DS_RLHF_SANDBOX_NO_NETWORK", "LC_CTYPE",
                        "DS_RLHF_SANDBOX_CALL"}
    assert "ds_rlhf_tool_" in env["HOME"] and env["TMPDIR"] == env["HOME"]
    assert env["DS_RLHF_SANDBOX_NO_NETWORK"] == result.network != ""


def namespaces_allowed() -> bool:
    """Whether a fresh process may unshare(CLONE_NEWUSER | CLONE_NEWNET) here."""
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) != 0)"
    return sys.platform.startswith("linux") and subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_network_namespace_cuts_raw_sockets_and_other_programs(net_tools, listener):
    open_raw = Sandbox(no_network=False).call(net_tools.raw_dial, {"port": listener})
    open_child = Sandbox(no_network=False).call(net_tools.child_fetch, {"port": listener})
    assert open_raw.value == "connected" and open_child.value.startswith("rc=0 out=200"), (open_raw, open_child)
    if not namespaces_allowed():
        pytest.skip("this kernel refuses an unprivileged user + network namespace")
    raw = Sandbox().call(net_tools.raw_dial, {"port": listener})
    assert raw.status == "error" and "unreachable" in raw.error.lower(), raw
    child = Sandbox().call(net_tools.child_fetch, {"port": listener})
    assert child.ok and child.network == "namespace" and child.value.startswith("rc=1 "), child
    assert "unreachable" in child.value.lower()
    ids = Sandbox().run_code("import os; print(os.getuid(), os.getgid())")
    assert ids.network == "namespace" and ids.output.split() == [str(os.getuid()), str(os.getgid())]


def test_python_sockets_are_refused():
    result = Sandbox().call(h.dial, {})
    assert result.status == "error" and "network access is disabled" in result.error
    assert Sandbox(no_network=False).call(h.dial, {}).error.startswith("ConnectionRefusedError")


def test_only_module_level_functions_can_be_sandboxed():
    def local(x: int) -> int:
        return x

    assert tool_location(h.add)[1] == "add"
    with pytest.raises(ConfigError, match="module-level function"):
        tool_location(local)
