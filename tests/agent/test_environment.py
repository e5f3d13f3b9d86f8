"""Environments and tools as users write them: JSON-schema specs from typed, documented functions, loading by
`path.py:Name`, sync and async environments, and the tool environment's steps."""

from __future__ import annotations

from pathlib import Path

import agent_helpers as h
import pytest

from ds_rlhf.agent.environment import ToolEnvironment, load_environment, run_reset, run_step, tool_specs
from ds_rlhf.agent.sandbox import Sandbox
from ds_rlhf.config import ConfigError

HELPERS = str(Path(h.__file__))


def test_tool_specs_from_hints_and_docstrings():
    (spec,) = tool_specs([h.add])
    assert spec["function"]["name"] == "add" and spec["function"]["description"] == "Add two integers."
    assert spec["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first integer"}
    assert spec["function"]["parameters"]["required"] == ["a", "b"]

    def bare(x):
        return x

    with pytest.raises(ConfigError, match="tool bare: .*docstring"):
        tool_specs([bare])


def test_load_environment_class_and_tool_list():
    env = load_environment(f"{HELPERS}:EchoEnv")()
    assert run_reset(env, "cats") == "Say something about cats."
    tools = load_environment(f"{HELPERS}:TOOLS")()
    assert isinstance(tools, ToolEnvironment) and sorted(tools.tools) == ["add", "hang"]


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "give path/to/file.py:Name"),
    ("missing.py:Env", "file not found: missing.py"),
    (f"{HELPERS}:Nope", "has no 'Nope'"),
    (f"{HELPERS}:NOT_TOOLS", "NOT_TOOLS is a int"),
    (f"{HELPERS}:NoStep", "class NoStep has no step method"),
])
def test_load_environment_errors_name_the_input(spec, words):
    with pytest.raises(ConfigError) as err:
        load_environment(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_sync_and_async_environments_step_alike():
    for cls in (h.EchoEnv, h.AsyncEchoEnv):
        env = cls()
        assert run_reset(env, "dogs") == "Say something about dogs."
        first, second = run_step(env, "woof"), run_step(env, "bark")
        assert first.messages == [{"role": "user", "content": "You said: woof"}] and not first.done
        assert (second.reward, second.done) == (1.0, True)


def test_tool_environment_steps():
    env = ToolEnvironment([h.add, h.boom], reward_fn=lambda text, row: float("3" in text))
    env.reset({"prompt": "add 1 and 2"})
    call = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert call.messages == [{"role": "tool", "name": "add", "content": "3"}] and not call.done and not call.reports
    bad = env.step("<tool_call>{oops}</tool_call>")
    assert "not valid JSON" in bad.messages[0]["content"] and bad.reports[0]["status"] == "parse_error"
    raised = env.step('boom("bad day")')
    assert raised.messages[0]["content"] == "[tool boom failed: RuntimeError: bad day]"
    assert raised.reports == [{"tool": "boom", "status": "error", "error": "RuntimeError: bad day"}]
    final = env.step("It is 3.")
    assert final.done and final.reward == 1.0 and final.messages == []


def test_tool_environment_in_the_sandbox():
    # no wall-clock bound a loaded machine could pass: a generous timeout for the call that returns, a short one
    # only for the call that never does
    env = ToolEnvironment([h.add], sandbox=Sandbox(timeout_s=120))
    env.reset("go")
    assert env.step("add(2, 3)").messages[0]["content"] == "5"
    env = ToolEnvironment([h.hang], sandbox=Sandbox(timeout_s=1.0))
    env.reset("go")
    hung = env.step("hang()")
    assert "wall timeout" in hung.messages[0]["content"] and hung.reports[0]["status"] == "timeout"
