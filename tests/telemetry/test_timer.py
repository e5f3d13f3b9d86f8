"""PhaseTimer: nested phases are charged exclusively, so time/step counts every second once."""

from __future__ import annotations

import time

import pytest

from ds_rlhf.telemetry import PhaseTimer


def test_nested_phase_moves_its_time_out_of_the_outer_one():
    timer = PhaseTimer()
    with timer.phase("rollout"):
        time.sleep(0.02)
        with timer.phase("data"):
            time.sleep(0.05)
        time.sleep(0.02)
    with timer.phase("data"):
        time.sleep(0.01)
    out = timer.pop()
    assert out["time/data"] == pytest.approx(0.06, abs=0.02)
    assert out["time/rollout"] == pytest.approx(0.04, abs=0.02)
    assert out["time/step"] == pytest.approx(out["time/data"] + out["time/rollout"])
    names = [e[0] for e in timer.events]
    assert names == ["data", "rollout", "data"]  # the inner event lies inside the outer one
    inner, outer = timer.events[0], timer.events[1]
    assert outer[1] <= inner[1] and inner[2] <= outer[2] + 1e-3
    assert timer.pop() == {"time/step": 0.0}


def test_an_exception_inside_a_nested_phase_still_charges_both():
    timer = PhaseTimer()
    with pytest.raises(StopIteration), timer.phase("rollout"), timer.phase("data"):
        raise StopIteration
    out = timer.pop()
    assert set(out) == {"time/rollout", "time/data", "time/step"}
