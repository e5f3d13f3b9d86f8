"""`PacedCalculatorEnv`: the calculator environment whose steps take a random while (jitter seeded from the OS, so
an episode batch's steps finish in a different order on every run). With `STEP_MARKER` set in the environment, each
step first appends a line to that file and then sleeps a second: a test reading the file knows when episodes are
being played and can kill the run in the middle of them. Loaded by path (`--env.name this_file:Name`)."""

from __future__ import annotations

import os
import random
import time

from ds_rlhf.agent.examples.calculator import CalculatorEnv

STEP_MARKER = "DS_RLHF_TEST_STEP_MARKER"
_jitter = random.Random()  # OS-seeded on purpose: the steps' timing is not reproducible


class PacedCalculatorEnv(CalculatorEnv):
    def step(self, action_text: str):
        marker = os.environ.get(STEP_MARKER)
        if marker:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()} {time.time():.3f}\n")
            time.sleep(1.0)
        time.sleep(_jitter.uniform(0.0, 0.05))
        return super().step(action_text)
