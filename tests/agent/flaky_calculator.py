"""`FlakyCalculatorEnv`: the calculator environment, except that the step of an episode on "9 - 4" hangs (until
`RELEASE` is set, at most 120 s) and the step of an episode on "6 * 7" raises. Loaded by path
(`--env.name this_file:FlakyCalculatorEnv`)."""

from __future__ import annotations

import threading

from ds_rlhf.agent.examples.calculator import CalculatorEnv

RELEASE = threading.Event()


class FlakyCalculatorEnv(CalculatorEnv):
    def reset(self, row) -> str:
        self.question = row["prompt"]
        return super().reset(row)

    def step(self, action_text: str):
        if "9 - 4" in self.question:
            RELEASE.wait(120)
        if "6 * 7" in self.question:
            raise RuntimeError("the calculator's backend is down")
        return super().step(action_text)
