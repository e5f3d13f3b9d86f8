"""Calling conventions: ours (per sample or batched), TRL's, verl's and OpenRLHF's, detected from the signature.

Every function is turned into `call(items) -> list of raw values`, one per item, and `invoke` turns those into
outcomes: `(score, extra_metrics)` for a good value, or a string saying why the value is bad. The same code runs
in-process and inside a pool worker. `async def` functions (of any style) are awaited: the coroutine a call returns,
or the coroutines in the list it returns, gathered; `invoke`'s `timeout` cuts the wait off.

An item is a dict with `prompt` (the rendered prompt text), `response`, `ground_truth`, `metadata`, `id` and, for a
conversational prompt, `prompt_messages` (its chat messages, `[{"role": ..., "content": ...}, ...]`). TRL-style
functions then get TRL's conversational form: `prompts` as those message lists and each completion as
`[{"role": "assistant", "content": response}]`; for other prompts, and for the other styles, plain strings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
from collections.abc import Callable
from functools import partial

from ds_rlhf.rewards.loading import STYLES
from ds_rlhf.rewards.remote import with_logs

Outcome = tuple[float, dict[str, float]] | str
F32_MAX = 3.4028234663852886e38  # the largest finite float32; a larger score becomes inf in the loss
BATCHED_STYLES = ("batched", "trl", "openrlhf")


class BadRewardError(RuntimeError):
    """A reward function raised or returned a non-finite value and the policy is `fail`; or a reward (a function's,
    an environment's) that is not a number at all (a bool, a string), whatever the policy."""


class BadValue(str):
    """A value a reward function returns for one item it could not score: the item is a bad reward with this
    reason (`reward.on_bad` applies), counted as `<function>/<kind>` in the batch's metrics (`scoring.py`)."""

    def __new__(cls, reason: str, kind: str = "bad"):
        value = super().__new__(cls, reason)
        value.kind = kind
        return value


class Refused(str):
    """The reason for a value whose type is not a reward (a bool, a string): the function itself is wrong, not one
    sample, so `scoring` stops the run under any `reward.on_bad`."""


def detect_style(fn: Callable) -> str:
    """`reward_style` attribute if set, else from parameter names: TRL `completions`, verl `solution_str`,
    OpenRLHF `queries`, ours batched `(prompts, responses, ...)`, otherwise ours per sample."""
    explicit = getattr(fn, "reward_style", None)
    if explicit is not None:
        if explicit not in STYLES:
            raise ValueError(f"reward_style must be one of {STYLES}, got {explicit!r}")
        return explicit
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: the default convention
        return "sample"
    if "completions" in names:
        return "trl"
    if "solution_str" in names:
        return "verl"
    if "queries" in names:
        return "openrlhf"
    return "batched" if names[:2] == ["prompts", "responses"] else "sample"


def make_call(fn: Callable, style: str) -> Callable[[list[dict]], object]:
    return partial({"sample": _call_sample, "batched": _call_batched, "trl": _call_trl, "verl": _call_verl,
                    "openrlhf": _call_openrlhf}[style], fn)


def _columns(items: list[dict]) -> tuple[list, list, list, list]:
    return ([it["prompt"] for it in items], [it["response"] for it in items],
            [it.get("ground_truth") for it in items], [it.get("metadata") or {} for it in items])


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _call_sample(fn, items):
    return [fn(p, r, gt, md) for p, r, gt, md in zip(*_columns(items))]


def _call_batched(fn, items):
    return fn(*_columns(items))


def _call_trl(fn, items):
    """TRL: `f(prompts, completions, **kwargs)`; kwargs are dataset columns (the truth under its usual names).
    Conversational items (with `prompt_messages`) pass TRL's chat form: the prompt's messages and the completion as
    `[{"role": "assistant", "content": text}]`; others the plain strings."""
    prompts, responses, truths, metas = _columns(items)
    chat = [it.get("prompt_messages") for it in items]
    prompts = [list(m) if m else p for m, p in zip(chat, prompts)]
    completions = [[{"role": "assistant", "content": r}] if m else r for m, r in zip(chat, responses)]
    columns = {"ground_truth": truths, "answer": truths, "solution": truths}
    for key in dict.fromkeys(k for md in metas for k in md):
        columns.setdefault(key, [md.get(key) for md in metas])
    return fn(prompts=prompts, completions=completions, **_accepted(fn, columns))


def _call_verl(fn, items):
    """verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, per sample."""
    extra = _accepted(fn, {"extra_info": None})
    return [fn(data_source=md.get("data_source"), solution_str=r, ground_truth=gt,
               **({"extra_info": md} if extra else {})) for _, r, gt, md in zip(*_columns(items))]


def _call_openrlhf(fn, items):
    """OpenRLHF: `reward_func(queries, prompts, labels)`; queries are prompt + response. Returns a tensor/list
    or a dict with `rewards` (and optionally per-sample `extra_logs`)."""
    prompts, responses, truths, _ = _columns(items)
    result = fn([p + r for p, r in zip(prompts, responses)], prompts, truths)
    if not isinstance(result, dict):
        return result
    if "rewards" not in result:
        raise ValueError(f"returned a dict without 'rewards' (keys {sorted(result)})")
    rewards = as_list(result["rewards"])
    if rewards is None:
        return result["rewards"]
    logs = {k: as_list(v) for k, v in (result.get("extra_logs") or {}).items()}
    return with_logs(rewards, {k: v for k, v in logs.items() if v is not None})


def as_list(value) -> list | None:
    """A list, tuple, 1-d tensor or array as a list; anything else None."""
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        converted = value.tolist()
        return converted if isinstance(converted, list) else None
    return None


def _describe(value) -> str:
    try:
        text = repr(value)
    except Exception:
        text = "?"
    return f"{type(value).__name__} {text[:60]}"


def _number(value) -> float | None:
    """A real number (int, float, numpy/torch scalar) as float, else None; never a bool or a string."""
    try:
        if not isinstance(value, numbers.Real) and hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):  # a subclass of int, but True is no reward of 1.0
            return None
        return float(value) if isinstance(value, numbers.Real) else None
    except Exception:  # overflowing ints, multi-element tensors
        return None


def wrong_type(value) -> str | None:
    """Why `value` (or a numpy/torch scalar holding it) is of a type that is never a reward (a bool, a string);
    None for any other value."""
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        try:
            value = value.item()
        except Exception:  # multi-element tensors: not a number, but not this refusal
            return None
    if isinstance(value, bool):
        return f"returned {_describe(value)}: a bool is not a reward; return a number (e.g. float(ok))"
    if isinstance(value, str | bytes):
        return f"returned {_describe(value)}: a string is not a reward; return a number (e.g. float(text))"
    return None


def reward_number(value, who: str) -> float:
    """An environment's reward as float: BadRewardError naming `who` for a bool or a string (a type no reward
    has: refused, whatever the policy), ValueError for any other value that is not a real number finite in
    float32 (the episode's failure: `env.on_bad_tool`)."""
    refused = wrong_type(value)
    if refused is not None:
        raise BadRewardError(f"{who} {refused}")
    number = _number(value)
    if number is None:
        raise ValueError(f"{who} returned {_describe(value)}, not a number")
    if not (math.isfinite(number) and abs(number) <= F32_MAX):
        raise ValueError(f"{who} returned a reward {number:g}, which is not finite in float32")
    return number


def to_outcome(value) -> Outcome:
    """A float or a dict with `score` (+ numeric extras) -> (score, extras); anything else a reason string (a
    `Refused` one for a bool or a string score)."""
    extras: dict[str, float] = {}
    if isinstance(value, BadValue):
        return value
    if isinstance(value, dict):
        if "score" not in value:
            return f"returned a dict without a 'score' key (keys {sorted(map(str, value))[:8]})"
        for key, raw in value.items():
            number = _number(raw)
            if key != "score" and number is not None and math.isfinite(number) and abs(number) <= F32_MAX:
                extras[str(key)] = number
        value = value["score"]
    refused = wrong_type(value)
    if refused is not None:
        return Refused(refused)
    score = _number(value)
    if score is None:
        return f"returned {_describe(value)}, not a number"
    if not math.isfinite(score):
        return f"returned {score}"
    if abs(score) > F32_MAX:
        return f"returned {score:g}, which is not finite in float32"
    return score, extras


class _Expired(Exception):
    """An awaited reward call ran past its timeout."""


async def _settle(raw, timeout: float | None):
    """`raw` with its awaitables awaited: a coroutine (an `async def` batched function), or a list holding some
    (an `async def` per-sample function), gathered concurrently; all of it within `timeout` seconds."""

    async def one(value):
        return await value if inspect.isawaitable(value) else value

    async def every():
        value = await one(raw)
        if isinstance(value, list) and any(inspect.isawaitable(v) for v in value):
            return list(await asyncio.gather(*(one(v) for v in value)))
        return value

    try:
        async with asyncio.timeout(timeout) as deadline:
            return await every()
    except TimeoutError:
        if deadline.expired():  # our deadline, not a TimeoutError the function raised itself
            raise _Expired from None
        raise


def _has_awaitable(raw) -> bool:
    return inspect.isawaitable(raw) or (isinstance(raw, list) and any(inspect.isawaitable(v) for v in raw))


def _await(raw, timeout: float | None):
    """Run `_settle` to completion: on a fresh event loop, or in a helper thread when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_settle(raw, timeout))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _settle(raw, timeout)).result()


def invoke(call: Callable[[list[dict]], object], items: list[dict], in_worker: bool,
           timeout: float | None = None) -> list[Outcome]:
    """Run one call and judge each value. Any BaseException from user code is a bad reward, except a
    KeyboardInterrupt in-process: there it is indistinguishable from Ctrl-C, which must stop the trainer.
    An `async def` function's result is awaited, for at most `timeout` seconds (None: no limit)."""
    n = len(items)
    try:
        raw = call(items)
        if _has_awaitable(raw):
            raw = _await(raw, timeout)
    except _Expired:
        return [f"timed out after {timeout:g}s"] * n
    except KeyboardInterrupt:
        if not in_worker:
            raise
        return ["raised KeyboardInterrupt"] * n
    except BaseException as exc:  # SystemExit, GeneratorExit, ... from user code: reported per sample
        return [f"raised {type(exc).__name__}: {exc}"] * n
    values = as_list(raw)
    if values is None or len(values) != n:
        return [f"returned {_describe(raw)} for a batch of {n} samples"] * n
    return [to_outcome(v) for v in values]
