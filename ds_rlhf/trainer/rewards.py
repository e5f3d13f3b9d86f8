"""Rewards: rule functions (GSM8K-style exact match, format check), user functions, and the bad-reward policy.

A reward function receives (prompt, response, ground_truth, metadata) and returns a float. One that raises or
returns NaN/inf is never averaged in silently: each bad sample is counted and reported with its id, then the
declared policy applies — `fail` stops the run, `zero` scores it 0, `drop` removes the sample from the update.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RewardFn = Callable[[str, str, str | None, dict], float]
_FINAL_NUMBER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


class BadRewardError(RuntimeError):
    """A reward function raised or returned a non-finite value and the policy is `fail`."""


def extract_final_number(text: str) -> str | None:
    """The number after the last `####`, commas removed (GSM8K's answer convention)."""
    found = _FINAL_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return a.strip() == b.strip()


def gsm8k_reward(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """1.0 when the number after `####` equals the ground truth, else 0.0."""
    if ground_truth is None:
        raise ValueError("gsm8k reward needs a ground truth; the prompt store has none for this row")
    answer = extract_final_number(response)
    return 1.0 if answer is not None and _same_number(answer, str(ground_truth)) else 0.0


def format_reward(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """1.0 when the response ends its reasoning with `#### <number>` and is not empty, else 0.0."""
    return 1.0 if extract_final_number(response) is not None else 0.0


def shaped_math_reward(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """Half for the graded `#### <number>` format, half for the right number: 0, 0.5 or 1.0.

    The format half gives a partly trained model a learning signal before its answers are right (the built-in
    demo's SFT data uses that format only half the time, so RL has something it can visibly fix in minutes).
    """
    return 0.5 * format_reward(prompt, response, ground_truth, metadata) + 0.5 * gsm8k_reward(
        prompt, response, ground_truth, metadata)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "format": format_reward,
    "math_shaped": shaped_math_reward,
}


def load_reward_fn(spec: str) -> RewardFn:
    """`gsm8k` / `format` / `math_shaped`, or `path/to/file.py:function_name`."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward function '{spec}': use one of {sorted(BUILTIN_REWARDS)} "
                         "or path/to/file.py:function_name")
    path, name = spec.rsplit(":", 1)
    if not Path(path).is_file():
        raise FileNotFoundError(f"reward function file not found: {path}")
    module_spec = importlib.util.spec_from_file_location(f"ds_rlhf_user_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} has no callable '{name}'")
    return fn


@dataclass
class RewardReport:
    """Scores for a batch plus which samples were bad and why."""

    scores: list[float]
    keep: list[bool]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (sample id, reason)


def score_samples(fn: RewardFn, items: list[dict], on_bad: str) -> RewardReport:
    """Apply `fn` to items with keys prompt, response, ground_truth, metadata, id; enforce the bad-reward policy."""
    if on_bad not in ("fail", "zero", "drop"):
        raise ValueError(f"on_bad_reward must be fail, zero or drop, got '{on_bad}'")
    scores, keep, bad = [], [], []
    for item in items:
        reason = None
        try:
            value = float(fn(item["prompt"], item["response"], item.get("ground_truth"), item.get("metadata", {})))
            if not math.isfinite(value):
                reason = f"returned {value}"
        except Exception as exc:  # a user function's bug must be reported per sample, not crash opaquely
            value, reason = 0.0, f"raised {type(exc).__name__}: {exc}"
        if reason is not None:
            bad.append((str(item["id"]), reason))
            value = 0.0
        scores.append(value)
        keep.append(reason is None or on_bad != "drop")
    if bad and on_bad == "fail":
        listed = "; ".join(f"{sid}: {why}" for sid, why in bad[:5])
        raise BadRewardError(f"{len(bad)} bad reward(s) (policy 'fail'): {listed}"
                             + (" ..." if len(bad) > 5 else ""))
    return RewardReport(scores, keep, bad)
