"""Helpers of the learning benchmark's tests (test_bench_learn.py, test_bench_learn_results.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = "ds_rlhf/agent/examples/calculator.py:CalculatorEnv"  # as a user passes it, from the repository


def bench_module(monkeypatch, name: str = "learn"):
    """bench/<name>.py (learn.py, or a sibling such as learn_results.py or learn_seeds.py) as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when the script runs: its folder first on the path
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
