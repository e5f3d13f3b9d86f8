"""Rewards of the learning benchmark's tasks: plain functions of (prompt, response, ground truth), no imports of
ds_rlhf, so any trainer can call them (TRL: wrap as `lambda completions, label, **kw: [correct(None, c, g) for c, g
in zip(completions, label)]`).

The answer rule (`final_number`): the response gives its answer once, as `#### N` at its very end (trailing spaces
or a full stop allowed), and `####` appears nowhere else. A response that repeats `####`, lists several numbers after
it or keeps writing past its answer has no answer.

- `correct`: 1.0 when the response's answer equals the ground truth, else 0.0 (the exact-match metric).
- `formatted`: 1.0 when the response has an answer by that rule, else 0.0 (format compliance).
- `train_reward`: what the benchmark trains on: 1.0 correct, 0.1 for a wrong answer in the right format, else 0.
- `eval_reward`: `correct` as the score, with `formatted` and `lenient` as extra metrics.
- `lenient_train_reward` / `lenient_correct`: the same with the last number after any `####` as the answer,
  wherever it stands. A policy trained on it can game it: writing `####` again and again with several guesses and
  never ending its turn scores as often as one of the guesses is right (`bench/learn.py --reward lenient` trains on
  it; `docs/PERFORMANCE.md` shows such a run).
"""

from __future__ import annotations

import re

_NUMBER = r"\$?\s*(-?[\d,]*\.?\d+)"
_ANY = re.compile(r"####\s*" + _NUMBER)
_AT_END = re.compile(r"####\s*" + _NUMBER + r"\s*\.?\s*\Z")


def final_number(response: str) -> str | None:
    """The answer: the number of the one `####` the response holds, when that `#### N` ends the response."""
    if response.count("####") != 1:
        return None
    found = _AT_END.search(response)
    return found[1].replace(",", "") if found else None


def lenient_final_number(response: str) -> str | None:
    """The number after the last `####`, wherever it stands."""
    found = _ANY.findall(response)
    return found[-1].replace(",", "") if found else None


def _equal(answer: str | None, ground_truth) -> float:
    if answer is None or ground_truth is None:
        return 0.0
    try:
        return float(abs(float(answer) - float(str(ground_truth).replace(",", ""))) < 1e-6)
    except ValueError:
        return 0.0


def correct(prompt, response: str, ground_truth, metadata=None) -> float:
    return _equal(final_number(response), ground_truth)


def lenient_correct(prompt, response: str, ground_truth, metadata=None) -> float:
    return _equal(lenient_final_number(response), ground_truth)


def formatted(prompt, response: str, ground_truth=None, metadata=None) -> float:
    return float(final_number(response) is not None)


def train_reward(prompt, response: str, ground_truth, metadata=None) -> float:
    if correct(prompt, response, ground_truth):
        return 1.0
    return 0.1 * formatted(prompt, response)


def lenient_train_reward(prompt, response: str, ground_truth, metadata=None) -> float:
    if lenient_correct(prompt, response, ground_truth):
        return 1.0
    return 0.1 * float(lenient_final_number(response) is not None)


def eval_reward(prompt, response: str, ground_truth, metadata=None) -> dict:
    return {"score": correct(prompt, response, ground_truth), "format": formatted(prompt, response),
            "lenient": lenient_correct(prompt, response, ground_truth)}
