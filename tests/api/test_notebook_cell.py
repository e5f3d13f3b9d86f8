"""The README's notebook cell ("From Python"), run as it is in this process: a prompt store made from Python, GRPO on
the tiny model for two steps with a lambda reward, `train()` returning the run's records. Every callable the cell
gives `RLTrainer.from_config` is wrapped (the API's `register`) to count its calls."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from ds_rlhf import api

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_cell() -> str:
    section = README.read_text().split("## From Python (a notebook)\n", 1)[1].split("\n## ", 1)[0]
    cells = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(cells) == 1, "the README's 'From Python' section holds one python cell"
    return cells[0]


@pytest.mark.slow
def test_the_readme_notebook_cell_trains_two_steps_with_a_lambda_reward(tiny_model_path, tmp_path, monkeypatch):
    calls: list[int] = []

    def counting(name, obj):
        @functools.wraps(obj)  # the signature (TRL's, here) stays visible to the style detection
        def wrapper(*args, **kwargs):
            calls.append(1)
            return obj(*args, **kwargs)
        return register(name, wrapper)

    register = api.register
    monkeypatch.setattr(api, "register", counting)
    monkeypatch.chdir(tmp_path)
    cell = readme_cell()
    assert "lambda prompts, completions" in cell
    scope: dict = {}
    exec(compile(cell, "README.md", "exec"), scope)

    result = scope["result"]
    run = tmp_path / "runs" / "notebook" / "run"
    assert calls, "the lambda reward was never called"
    assert Path(result.run_dir).resolve() == run.resolve()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)
    assert [r["step"] for r in result.history] == [1, 2] and result.metrics["step"] == 2
    assert json.loads((run / "config.json").read_text())["reward"]["fn"].startswith("python:lambda")
