"""The built-in synthetic task: two-number addition with the answer after ``####``.

It is small enough for a tiny model to learn on one CPU in minutes, and its reward is a rule, so a rising reward
curve proves the RL loop works without any downloaded model or dataset. The answer format mirrors GSM8K's
(``#### <number>``), so the same rule reward (`ds_rlhf.rewards.gsm8k_reward`) scores both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def solution(self) -> str:
        """The reference response SFT is trained on."""
        return f"{self.a} + {self.b} = {self.answer}. #### {self.answer}"


def make_problems(n: int, seed: int, max_operand: int = 99) -> list[AdditionProblem]:
    """Deterministic list of problems; the same (n, seed, max_operand) always gives the same list."""
    rng = random.Random(seed)
    return [AdditionProblem(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]


def prompt_rows(n: int, seed: int, max_operand: int = 99) -> list[dict]:
    """Rows in the OpenRLHF-style prompt format data_prep reads (`prompt`, `label`)."""
    return [{"prompt": p.prompt, "label": str(p.answer), "data_source": "addition"}
            for p in make_problems(n, seed, max_operand)]


def sft_rows(n: int, seed: int, max_operand: int = 99, plain_fraction: float = 0.0) -> list[dict]:
    """Rows as chat conversations for SFT (`messages`).

    `plain_fraction` of the demonstrations end "The answer is N." instead of "#### N": a model trained on them
    uses the graded format only part of the time, which is exactly what a format-aware rule reward then fixes
    with RL (the demo's learning signal).
    """
    rng = random.Random(seed + 104729)
    rows = []
    for p in make_problems(n, seed, max_operand):
        plain = f"{p.a} + {p.b} = {p.answer}. The answer is {p.answer}."
        answer = p.solution if rng.random() >= plain_fraction else plain
        rows.append({"messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": answer}]})
    return rows


def preference_rows(n: int, seed: int, max_operand: int = 99) -> list[dict]:
    """Chosen/rejected pairs with learnable rules: the chosen response is right and well-formed; the rejected one
    either drops the `#### <answer>` ending (a format rule any small model learns) or states a wrong sum."""
    rng = random.Random(seed + 7919)
    rows = []
    for p in make_problems(n, seed, max_operand):
        if rng.random() < 0.5:
            rejected = f"{p.a} + {p.b} is {p.answer}."
        else:
            wrong = p.answer + rng.choice([-10, -2, -1, 1, 2, 10])
            rejected = f"{p.a} + {p.b} = {wrong}. #### {wrong}"
        user = {"role": "user", "content": p.prompt}
        rows.append({"chosen": [user, {"role": "assistant", "content": p.solution}],
                     "rejected": [user, {"role": "assistant", "content": rejected}]})
    return rows
