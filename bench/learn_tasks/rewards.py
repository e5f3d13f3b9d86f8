"""Rewards of the learning benchmark's tasks: plain functions of (prompt, response, ground truth), no imports of
ds_rlhf, so any trainer can call them (TRL: wrap as `lambda completions, label, **kw: [correct(None, c, g) for c, g
in zip(completions, label)]`).

- `correct`: 1.0 when the number after the last `####` equals the ground truth, else 0.0 (the exact-match metric).
- `formatted`: 1.0 when the response gives a number after `####`, else 0.0 (format compliance).
- `train_reward`: what the benchmark trains on: 1.0 correct, 0.1 for a wrong answer in the right format, else 0.
- `eval_reward`: `correct` as the score, with `formatted` as an extra metric.
"""

from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def final_number(response: str) -> str | None:
    found = _FINAL.findall(response)
    return found[-1].replace(",", "") if found else None


def correct(prompt, response: str, ground_truth, metadata=None) -> float:
    answer = final_number(response)
    if answer is None or ground_truth is None:
        return 0.0
    try:
        return float(abs(float(answer) - float(str(ground_truth).replace(",", ""))) < 1e-6)
    except ValueError:
        return 0.0


def formatted(prompt, response: str, ground_truth=None, metadata=None) -> float:
    return float(final_number(response) is not None)


def train_reward(prompt, response: str, ground_truth, metadata=None) -> float:
    if correct(prompt, response, ground_truth):
        return 1.0
    return 0.1 * formatted(prompt, response)


def eval_reward(prompt, response: str, ground_truth, metadata=None) -> dict:
    return {"score": correct(prompt, response, ground_truth), "format": formatted(prompt, response)}
