"""A reward function of your own for `--reward.fn examples/reward.py:reward` (the quick start's REWARD).

Per sample: the prompt, the response, the row's ground truth (the prompts file's `answer`) and its metadata; returns
a float (or a dict with `score` and extra metrics, each logged as `reward/<name>`).
"""

import re

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def reward(prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """1.0 for the right number after the last `####`, 0.2 for another number there, 0.0 without one."""
    found = FINAL.findall(response)
    if not found:
        return 0.0
    return 1.0 if ground_truth is not None and float(found[-1].replace(",", "")) == float(ground_truth) else 0.2
