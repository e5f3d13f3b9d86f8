"""The tool sandbox: each call in its own process, cut off at its wall timeout, CPU-time and memory limits, output
truncated, Python sockets refused; every failure is a result with an observation, never an exception."""

from __future__ import annotations

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
    assert result.status == "timeout" and result.seconds >= 1.0 and elapsed < 3.0
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
