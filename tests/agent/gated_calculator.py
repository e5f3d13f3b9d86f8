"""`GatedCalculatorEnv`: the calculator environment, except that the steps of every episode after the first
`FREE` (counted by `reset` calls, in order) wait for `GATE` to be set; `waiting` counts the steps waiting there.
A test can so hold a later batch's episodes in the middle of being played. Loaded by path
(`--env.name this_file:GatedCalculatorEnv`); the state is the class's."""

from __future__ import annotations

import itertools
import threading

from ds_rlhf.agent.examples.calculator import CalculatorEnv


class GatedCalculatorEnv(CalculatorEnv):
    FREE = 4
    GATE = threading.Event()
    resets = itertools.count()
    waiting = 0
    _lock = threading.Lock()

    def reset(self, row) -> str:
        self.ordinal = next(GatedCalculatorEnv.resets)
        return super().reset(row)

    def step(self, action_text: str):
        if self.ordinal >= self.FREE and not self.GATE.is_set():
            with self._lock:
                GatedCalculatorEnv.waiting += 1
            self.GATE.wait()
        return super().step(action_text)
