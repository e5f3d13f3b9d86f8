"""What a user writes for multi-turn episodes: an environment class, or a list of tool functions.

An environment is any class with

    reset(self, row) -> str                                   # the first user message of the episode
    step(self, action_text) -> (observation, reward, done)    # observation: str, reward: float, done: bool

(either may be `async def`; the reward is a real number finite in float32: a bool or a string stops the run, a
non-finite one ends the episode as failed). One instance serves one episode (the runner builds it with no
arguments), so it may keep the episode's state on `self`. `action_text` is the decoded assistant turn; the
observation becomes the next user turn.

Tools are plain Python functions with type hints and a Google-style docstring (`Args:` per parameter).
`tool_specs` turns them into the JSON-schema specs chat templates take (`apply_chat_template(tools=...)`) with
`transformers.utils.get_json_schema`, and `ToolEnvironment` is the environment that calls them: each assistant turn
is parsed for tool calls (`tool_calls.py`); calls run (in this process, or each in a `Sandbox` process) and their
results come back as tool turns; a turn without a call ends the episode and is scored by `reward_fn(text, row)`.

`load_environment("path/to/file.py:Name")` loads either from a file, as reward functions are loaded: `Name` is an
environment class, or a list / tuple of tool functions.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from ds_rlhf.agent.sandbox import Sandbox, tool_location
from ds_rlhf.agent.tool_calls import ParsedCalls, parse_tool_calls
from ds_rlhf.errors import ConfigError
from ds_rlhf.rewards.calling import reward_number
from ds_rlhf.rewards.loading import load_module, registered


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Any) -> str: ...

    def step(self, action_text: str) -> tuple[str, float, bool]: ...


@dataclass
class StepResult:
    """One environment step as the runner uses it: `messages` are the chat turns to render next (a user turn for
    an environment's observation, one tool turn per tool call), `reports` what went wrong (JSON-ready dicts)."""

    messages: list[dict]
    reward: float
    done: bool
    reports: list[dict] = field(default_factory=list)

    @property
    def observation(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


class StepTimeout(TimeoutError):
    """An environment call that passed its deadline: an `async def` one cancelled (`resolve`), a sync one abandoned
    in its thread (`episode.py`)."""


def resolve(value, timeout: float = 0.0):
    """The value of a sync or `async def` method's result (run in the calling thread's own event loop). With
    `timeout` > 0 a coroutine still running after that many seconds is cancelled (its `finally` blocks and
    context managers run) and `StepTimeout` is raised: an `async def` step past its deadline ends, where a sync
    one can only be abandoned. A `TimeoutError` of the coroutine's own passes through as it is."""
    if not inspect.isawaitable(value):
        return value
    return asyncio.run(_within(value, timeout) if timeout > 0 else value)


async def _within(awaitable, timeout: float):
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise StepTimeout(f"no result within {timeout:g} s (the coroutine was cancelled)") from None
        raise


def run_reset(env, row, timeout: float = 0.0) -> str:
    first = resolve(env.reset(row), timeout)
    if not isinstance(first, str):
        raise TypeError(f"{type(env).__name__}.reset must return the first user message (str), "
                        f"got {type(first).__name__}")
    return first


def run_step(env, action_text: str, timeout: float = 0.0) -> StepResult:
    """`env.step(action_text)` as a StepResult: a `ToolEnvironment`'s own, or a plain environment's
    (observation, reward, done) checked and turned into a user turn. `timeout`: as `resolve`'s."""
    out = resolve(env.step(action_text), timeout)
    if isinstance(out, StepResult):
        return out
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TypeError(f"{type(env).__name__}.step must return (observation: str, reward: float, done: bool), "
                        f"got {type(out).__name__}")
    observation, reward, done = out
    if not isinstance(observation, str):
        raise TypeError(f"{type(env).__name__}.step's observation must be str, got {type(observation).__name__}")
    reward = reward_number(reward, f"environment {type(env).__name__}.step")
    return StepResult([{"role": "user", "content": observation}], reward, bool(done))


def tool_specs(tools: Sequence[Callable]) -> list[dict]:
    """The JSON-schema spec of each tool function (`transformers.utils.get_json_schema`: name, the docstring's
    description, one typed property per parameter with its `Args:` description, the required ones)."""
    specs = []
    for fn in tools:
        try:
            specs.append(get_json_schema(fn))
        except (DocstringParsingException, TypeHintParsingException) as exc:
            name = getattr(fn, "__name__", repr(fn))
            raise ConfigError(f"tool {name}: {exc} (give it type hints and a docstring with an Args: line per "
                              "parameter)") from None
    return specs


class ToolEnvironment:
    """An environment over tool functions. Each step parses the assistant turn's tool calls (Hermes `<tool_call>`
    JSON, or a plain `name(...)` line): it runs each call and returns the results as tool turns (reward 0); a
    malformed call returns the parser's error as the tool turn (reported, the episode goes on); a turn with no
    call is the final answer: done, rewarded by `reward_fn(text, row)` (0 without one).

    `sandbox`: run each call in a `Sandbox` process (the functions must be module-level functions of a .py file);
    None runs them in the runner's worker thread (an `async def` tool in its own event loop), where an exception
    becomes the observation but nothing bounds the time a call takes."""

    def __init__(self, tools: Sequence[Callable], *, reward_fn: Callable[[str, Any], float] | None = None,
                 sandbox: Sandbox | None = None, prompt_key: str = "prompt") -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        self.specs = tool_specs(tools)
        self.params = {s["function"]["name"]: list(s["function"]["parameters"].get("properties", {}))
                       for s in self.specs}
        if sandbox is not None:
            for fn in tools:
                tool_location(fn)
        self.reward_fn, self.sandbox, self.prompt_key = reward_fn, sandbox, prompt_key
        self.row = None

    def reset(self, row) -> str:
        self.row = row
        if isinstance(row, str):
            return row
        if isinstance(row, dict) and isinstance(row.get(self.prompt_key), str):
            return row[self.prompt_key]
        raise TypeError(f"{type(self).__name__}.reset needs a str or a dict with a {self.prompt_key!r} string")

    def parse(self, text: str) -> ParsedCalls:
        return parse_tool_calls(text, self.params)

    def step(self, action_text: str) -> StepResult:
        parsed = self.parse(action_text)
        if not parsed.has_calls:
            reward = 0.0 if self.reward_fn is None else reward_number(self.reward_fn(action_text, self.row),
                                                                      f"environment {type(self).__name__}'s reward")
            return StepResult([], reward, True)
        if parsed.error is not None:
            message = {"role": "tool", "name": "error", "content": f"Error: {parsed.error}"}
            return StepResult([message], 0.0, False, [{"tool": "", "status": "parse_error", "error": parsed.error}])
        messages, reports = [], []
        for call in parsed.calls:
            text, report = self.call(call.name, call.arguments)
            messages.append({"role": "tool", "name": call.name, "content": text})
            if report is not None:
                reports.append(report)
        return StepResult(messages, 0.0, False, reports)

    def call(self, name: str, arguments: dict) -> tuple[str, dict | None]:
        """(observation text, report entry or None) of one call."""
        fn = self.tools[name]
        if self.sandbox is not None:
            result = self.sandbox.call(fn, arguments)
            return result.observation(name), None if result.ok and not result.truncated else result.report(name)
        try:
            value = resolve(fn(**arguments))
        except Exception as exc:  # noqa: BLE001  the tool's error is the model's observation
            error = f"{type(exc).__name__}: {exc}"
            return f"[tool {name} failed: {error}]", {"tool": name, "status": "error", "error": error}
        return ("(no output)" if value is None else str(value)), None


def load_object(spec: str):
    """The object `Name` of `path/to/file.py:Name` (the file imported through the reward functions' loader), or the
    one given in Python under `python:Name` (`rewards.loading.register`)."""
    if (given := registered(spec)) is not None:
        return given
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ConfigError(f"environment {spec!r}: give path/to/file.py:Name (an environment class or a list of "
                          "tool functions in that file)")
    if not Path(path).is_file():
        raise ConfigError(f"environment {spec!r}: file not found: {path}")
    module = load_module(path)
    if not hasattr(module, name):
        raise ConfigError(f"environment {spec!r}: {path} has no {name!r}")
    return getattr(module, name)


def environment_factory(obj, spec: str) -> Callable[[], Any]:
    """A factory making one environment per episode from `obj`: an environment class (reset/step), or a list or
    tuple of tool functions (a `ToolEnvironment` over them)."""
    name = spec.rpartition(":")[2]
    if inspect.isclass(obj):
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        if missing:
            raise ConfigError(f"environment {spec!r}: class {name} has no {' / '.join(missing)} method "
                              "(an environment has reset(row) -> str and step(text) -> (observation, reward, done))")
        return obj
    if isinstance(obj, (list, tuple)) and obj and all(callable(f) for f in obj):
        tools = list(obj)
        tool_specs(tools)  # a tool without hints or docstring is an error now, not at the first episode
        return lambda: ToolEnvironment(tools)
    raise ConfigError(f"environment {spec!r}: {name} is a {type(obj).__name__}; give an environment class or a "
                      "list of tool functions")


def load_environment(spec: str) -> Callable[[], Any]:
    """`path/to/file.py:Name` -> a factory making one environment per episode. `Name`: an environment class
    (reset/step), or a list or tuple of tool functions (a `ToolEnvironment` over them). `adapters.load_environment`
    (what `--env.name` uses) also takes environments written for TRL or OpenRLHF."""
    return environment_factory(load_object(spec), spec)
