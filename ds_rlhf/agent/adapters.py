"""Environments written for TRL or OpenRLHF, played by the episode runner as ds_rlhf environments.

`load_environment("path/to/file.py:Name")` (what `--env.name` loads) takes, besides a ds_rlhf environment
class or a list of tool functions (`environment.py`):

- TRL `GRPOTrainer(environment_factory=Name)`: a class built with no arguments whose public methods are the tools
  (type hints and a docstring with `Args:`, as for TRL), with `reset(**row)` and an optional `get_reward()`; it has
  no `step` method. `reset` gets the row's fields as keyword arguments (`prompt` is the question text) and returns
  None or a string appended to the prompt. Each turn's tool calls run the instance's methods (sync or
  `async def`); a result comes back as the tool turn `str(result)`, an exception as `str({"error": message})`, as
  TRL shows them. The first turn without a call ends the episode, rewarded by `get_reward()` (0 without one).
  TRL's `tools=` list is a list of tool functions, which `environment.py` loads as it is.
- OpenRLHF `--train.agent_func_path`: the `AgentExecutor` class (a `MultiTurnAgentExecutor` over an
  `AgentInstance` class), the `AgentInstance` class itself (`reset(states)` optional, `step(states)`; its `step`
  takes `states` or `state_dict`, or it derives from `AgentInstanceBase`), or a module-level
  `step(observation, action, label, **kwargs)` function (the older form, returning `next_observation`).
  `reset` gets `{"observation": prompt, "label": label}` and returns `{"observation": text}`, the first user
  message; `step` gets `observation_text` (the episode's text so far: the first observation, then each action and
  feedback), `action_text`, `label` and `sampling_params` (None) and returns `rewards` (a number or a one-element
  tensor), `environment_feedback` (the next user turn, rendered by the chat template, so it should be plain text
  without role markers) and `done`. `label` is the row's `label`, else its `answer`. `scores` and `extra_logs` are
  not used; a step that returns `sampling_params` or `environment_images` fails its episode (the runner samples
  every turn with the run's settings, and has no image turns).

What cannot be mapped is refused when the file is loaded, in one `ConfigError` line naming what is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ds_rlhf.agent.environment import ToolEnvironment, environment_factory, load_object, resolve
from ds_rlhf.errors import ConfigError
from ds_rlhf.rewards.calling import reward_number

_TRL_RESERVED = ("reset", "get_reward")


def load_environment(spec: str) -> Callable[[], Any]:
    """`path/to/file.py:Name` -> a factory making one environment per episode: a ds_rlhf environment class or tool
    list (`environment.environment_factory`), or an environment written for TRL or OpenRLHF (module docstring)."""
    obj = load_object(spec)
    factory = adapt(obj, spec)
    return factory if factory is not None else environment_factory(obj, spec)


def adapt(obj, spec: str) -> Callable[[], Any] | None:
    """A factory of wrapped environments when `obj` has TRL's or OpenRLHF's shape, else None."""
    name = spec.rpartition(":")[2]
    if inspect.isfunction(obj) or inspect.iscoroutinefunction(obj):
        params = list(inspect.signature(obj).parameters)
        if params[:3] == ["observation", "action", "label"]:
            return lambda: OpenRLHFStepFunction(obj)
        return None
    if not inspect.isclass(obj):
        return None
    if callable(getattr(obj, "execute", None)) and not callable(getattr(obj, "step", None)):
        return _openrlhf_executor(obj, spec, name)
    if _is_openrlhf_instance(obj):
        _build(obj, spec, name)  # a class that cannot be built with no arguments is an error now
        return lambda: OpenRLHFEnvironment(obj())
    if callable(getattr(obj, "reset", None)) and not callable(getattr(obj, "step", None)):
        tools = [m for m in _public_methods(obj) if m not in _TRL_RESERVED]
        if not tools and not callable(getattr(obj, "get_reward", None)):
            raise ConfigError(f"environment {spec!r}: class {name} has reset but no step, no public tool methods and "
                              "no get_reward: give a ds_rlhf environment (reset/step) or a TRL environment (tool "
                              "methods with type hints and docstrings, optional get_reward)")
        TRLEnvironment(_build(obj, spec, name))  # a probe: a tool without hints or docstring is an error now
        return lambda: TRLEnvironment(obj())
    return None


def _public_methods(cls) -> list[str]:
    return [n for n, m in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]


def _is_openrlhf_instance(cls) -> bool:
    if not callable(getattr(cls, "step", None)):
        return False
    if any(base.__name__ == "AgentInstanceBase" for base in cls.__mro__[1:]):
        return True
    params = list(inspect.signature(cls.step).parameters)
    return len(params) >= 2 and params[1] in ("states", "state_dict")


def _openrlhf_executor(cls, spec: str, name: str) -> Callable[[], Any]:
    executor = _build(cls, spec, name)
    instance_cls = getattr(executor, "agent_instance_cls", None)
    if not inspect.isclass(instance_cls) or not callable(getattr(instance_cls, "step", None)):
        raise ConfigError(f"environment {spec!r}: {name} has no agent_instance_cls with a step method (an executor "
                          "with its own execute() generates tokens itself, which the episode runner does; give a "
                          "MultiTurnAgentExecutor over an AgentInstance class, or the AgentInstance class)")
    _build(instance_cls, spec, instance_cls.__name__)
    return lambda: OpenRLHFEnvironment(instance_cls())


def _build(cls, spec: str, name: str):
    """`cls()`, the instance each episode gets; its error (or an `async def __init__`) as one ConfigError line."""
    if inspect.iscoroutinefunction(cls.__init__):
        raise ConfigError(f"environment {spec!r}: {name}.__init__ is async def; it is built with no arguments, once "
                          "per episode, outside an event loop: make __init__ a plain def")
    try:
        return cls()
    except Exception as exc:  # noqa: BLE001  the user's constructor: its error, on one line
        raise ConfigError(f"environment {spec!r}: {name}() raised {type(exc).__name__}: {exc} (it is built with no "
                          "arguments, once per episode)") from None


def _row_fields(row) -> dict:
    if isinstance(row, str):
        return {"prompt": row}
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return dict(row)
    raise TypeError("the row must be a str or a dict with a 'prompt' string")


def _number(value, what: str) -> float:
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        try:
            value = value.item()
        except (RuntimeError, ValueError):
            raise TypeError(f"{what} must be a number or a one-element tensor, got a tensor of "
                            f"{getattr(value, 'numel', lambda: '?')()} elements") from None
    return reward_number(value, what)


class TRLEnvironment(ToolEnvironment):
    """A TRL `environment_factory` instance as a ds_rlhf environment: its public methods are the tools, `reset`
    extends the prompt, `get_reward()` scores the final turn (module docstring)."""

    def __init__(self, instance) -> None:
        self.instance = instance
        methods = [getattr(instance, n) for n in _public_methods(type(instance)) if n not in _TRL_RESERVED]
        get_reward = getattr(instance, "get_reward", None)
        reward_fn = (lambda _text, _row: resolve(get_reward())) if callable(get_reward) else None
        super().__init__(methods, reward_fn=reward_fn)

    def reset(self, row) -> str:
        fields = _row_fields(row)
        self.row = row
        extra = resolve(self.instance.reset(**fields))
        if extra is None:
            return fields["prompt"]
        if not isinstance(extra, str):
            raise TypeError(f"{type(self.instance).__name__}.reset must return None or a str (appended to the "
                            f"prompt), got {type(extra).__name__}")
        return fields["prompt"] + extra

    def call(self, name: str, arguments: dict) -> tuple[str, dict | None]:
        try:
            value = resolve(self.tools[name](**arguments))
        except Exception as exc:  # noqa: BLE001  the tool's error is the model's observation, as TRL shows it
            return str({"error": str(exc)}), {"tool": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
        return str(value), None


class _OpenRLHFBase:
    """The text so far and the label of an OpenRLHF-style episode."""

    def _start(self, row) -> dict:
        fields = _row_fields(row)
        self.label = fields.get("label", fields.get("answer"))
        return fields

    def _feedback(self, out, who: str, key: str) -> tuple[str, float, bool]:
        if not isinstance(out, dict):
            raise TypeError(f"{who} must return a dict (rewards, {key}, done), got {type(out).__name__}")
        missing = [k for k in ("rewards", key, "done") if k not in out]
        if missing:
            raise KeyError(f"{who}'s result has no {', '.join(missing)}")
        for unsupported in ("sampling_params", "environment_images"):
            if out.get(unsupported):
                raise ValueError(f"{who} returned {unsupported}: the episode runner samples every turn with the run's "
                                 "settings and has no image turns; return None there")
        return out[key], _number(out["rewards"], f"{who}'s rewards"), bool(out["done"])


class OpenRLHFEnvironment(_OpenRLHFBase):
    """An OpenRLHF `AgentInstance` as a ds_rlhf environment (module docstring)."""

    def __init__(self, instance) -> None:
        self.instance = instance
        self.text, self.label = "", None

    def reset(self, row) -> str:
        fields = self._start(row)
        states = {"observation": fields["prompt"], "label": self.label}
        reset = getattr(self.instance, "reset", None)
        out = resolve(reset(states)) if callable(reset) else states
        first = out.get("observation") if isinstance(out, dict) else None
        if not isinstance(first, str):
            raise TypeError(f"{type(self.instance).__name__}.reset must return {{'observation': str}}, got "
                            f"{type(out).__name__}")
        self.text = first
        return first

    def step(self, action_text: str) -> tuple[str, float, bool]:
        states = {"observation_text": self.text, "action_text": action_text, "label": self.label,
                  "sampling_params": None}
        out = resolve(self.instance.step(states))
        feedback, reward, done = self._feedback(out, f"{type(self.instance).__name__}.step", "environment_feedback")
        if not isinstance(feedback, str):
            raise TypeError(f"environment_feedback must be a str, got {type(feedback).__name__}")
        self.text += action_text + feedback
        return feedback, reward, done


class OpenRLHFStepFunction(_OpenRLHFBase):
    """OpenRLHF's older agent function `step(observation, action, label, **kwargs)` as a ds_rlhf environment: the
    feedback is what `next_observation` adds after the observation and the action."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.text, self.label = "", None

    def reset(self, row) -> str:
        self.text = self._start(row)["prompt"]
        return self.text

    def step(self, action_text: str) -> tuple[str, float, bool]:
        out = resolve(self.fn(self.text, action_text, self.label))
        who = getattr(self.fn, "__name__", "step")
        following, reward, done = self._feedback(out, who, "next_observation")
        head = self.text + action_text
        if not isinstance(following, str) or not following.startswith(head):
            raise ValueError(f"{who}'s next_observation must be the observation, then the action, then the feedback "
                             "(observation + action + feedback)")
        self.text = following
        return following[len(head):], reward, done
