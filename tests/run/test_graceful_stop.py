"""`GracefulStop`: a stop signal reaches its `on_signal` callbacks, and what they set ends with the run (`on_exit`),
so a process that goes on after a stopped run (a notebook's next run, a test worker) starts without it."""

from __future__ import annotations

import os
import signal

import pytest

from ds_rlhf.rewards import bounded_http
from ds_rlhf.rewards.bounded_http import Interrupted, clear_interrupt, interrupt, pause
from ds_rlhf.run.signals import GracefulStop


def test_the_remote_rewards_stop_ends_with_the_run():
    seen = []
    try:
        with GracefulStop(announce=seen.append, on_signal=(interrupt,), on_exit=(clear_interrupt,)) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signum == signal.SIGTERM and seen
            with pytest.raises(Interrupted):  # inside the run: a retry after the signal is not worth it
                pause(0.01)
        try:  # after it: requests (and their retries) work again
            pause(0.01)
        except Interrupted:  # a KeyboardInterrupt: escaping, it would stop pytest itself
            pytest.fail("the run's stop outlived the run")
    finally:
        bounded_http.clear_interrupt()
