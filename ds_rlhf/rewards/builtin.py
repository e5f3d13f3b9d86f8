"""Built-in reward rules: GSM8K `####` exact match, format check, the shaped mix, math-verify for LaTeX, and unit
tests run in the tool sandbox (`code_tests`)."""

from __future__ import annotations

import importlib
import math
import re
import threading
from collections.abc import Callable

RewardFn = Callable[[str, str, str | None, dict], float]
_FINAL_NUMBER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own per-parse/per-compare alarm (main thread only)
# named as a string, loaded on first use: the tool sandbox it runs code in lives in the agent layer, above this one
CODE_REWARD = "ds_rlhf.agent.code_reward"


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


def math_verify_reward(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """1.0 when math-verify finds the response's answer (`\\boxed{}`, LaTeX or a plain number) equal to the truth.

    The ground truth may be bare (`\\frac{1}{2}`, `42`) or delimited (`$...$`, `\\boxed{...}`). math-verify's own
    timeouts use SIGALRM, which only works on the main thread; elsewhere they are off and the pool's timeout applies.
    """
    if ground_truth is None:
        raise ValueError("math_verify reward needs a ground truth; the prompt store has none for this row")
    from math_verify import parse, verify  # imported on first use: sympy costs ~0.5 s

    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    truth = str(ground_truth)
    delimited = "$" in truth or "\\boxed" in truth or "\\(" in truth
    gold = parse(truth if delimited else f"\\boxed{{{truth}}}", parsing_timeout=limit) or parse(
        truth, parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math_verify could not parse the ground truth {truth!r}")
    answer = parse(response, parsing_timeout=limit)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=limit) else 0.0


def code_tests_reward(prompts: list[str], responses: list[str], ground_truths: list, metadatas: list[dict]
                      ) -> list[dict]:
    """The pass fraction of each response's Python code against its row's tests, run in the tool sandbox, with
    per-sample test counts, timeouts and crashes as extra metrics (`ds_rlhf/agent/code_reward.py` has the rules)."""
    return importlib.import_module(CODE_REWARD).code_tests_reward(prompts, responses, ground_truths, metadatas)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "format": format_reward,
    "math_shaped": shaped_math_reward,
    "math_verify": math_verify_reward,
    "code_tests": code_tests_reward,
}
