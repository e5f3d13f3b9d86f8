"""bench/train_profile.py: the profile of one training phase (busy time, gaps, heaviest kernels or operators)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from ds_rlhf.telemetry.timer import PhaseTimer

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("train_profile", ROOT / "bench" / "train_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_time_is_the_union_of_intervals_and_gaps_lie_between_them():
    events = [("mm", 0.0, 10.0), ("add", 5.0, 20.0), ("scale", 6.0, 8.0), ("mm", 30.0, 40.0), ("copy", 60.0, 61.0)]
    out = load().summarize_events(events, wall_seconds=100e-6, step=3)
    assert out["busy_seconds"] == pytest.approx(31e-6)  # [0, 20] + [30, 40] + [60, 61]
    assert out["busy_frac"] == pytest.approx(0.31)
    assert out["kernel_seconds"] == pytest.approx(38e-6)  # overlap counted twice
    assert out["gaps"]["count"] == 2 and out["gaps"]["seconds"] == pytest.approx(30e-6)
    assert out["gaps"]["median_us"] == pytest.approx(15.0) and out["gaps"]["longest_us"] == [20.0, 10.0]
    assert [(t["name"], t["count"], t["total_ms"]) for t in out["top"]] == [
        ("mm", 2, pytest.approx(0.02)), ("add", 1, pytest.approx(0.015)), ("scale", 1, pytest.approx(0.002)),
        ("copy", 1, pytest.approx(0.001))]


def test_profiles_only_the_chosen_train_phase_and_passes_calls_on():
    calls = []

    class Inner:
        def enter(self, name):
            calls.append(("enter", name))

        def exit(self, name):
            calls.append(("exit", name))

    timer = PhaseTimer()
    prof = load().PhaseProfiler(2, inner=Inner())
    timer.observer = prof
    x = torch.randn(64, 64)
    sizes = {1: 8, 2: 64, 3: 8}
    for step in (1, 2, 3):
        with timer.phase("rollout"):
            torch.mm(x, x)
        with timer.phase("train"):
            n = sizes[step]
            for _ in range(5):
                torch.mm(x[:n, :n], x[:n, :n])
        if step == 1:
            assert prof.summary() is None
    out = prof.summary()
    assert out["step"] == 2 and out["device"] == "cpu"
    assert out["events"] >= 5 and 0 < out["busy_seconds"] <= out["wall_seconds"]
    mm = next(t for t in out["top"] if t["name"] == "aten::mm")
    assert mm["count"] == 5  # the second train phase's five products only: not the rollout's, not step 3's
    assert calls[:4] == [("enter", "rollout"), ("exit", "rollout"), ("enter", "train"), ("exit", "train")]
    assert len(calls) == 12
