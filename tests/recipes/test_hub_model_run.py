"""`ds-rlhf train-ppo --model.path ORG/NAME` as a user types it, in fresh processes, offline (as the tests run):
a Hub id that is not in the Hugging Face cache stops the run in one line before anything loads, and a model placed
in a Hub-style cache under a Hub id trains (actor, reference, rollout engine and tokenizer from its snapshot)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_rlhf.testing.hub_cache import place_in_hub_cache
from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.test_rl_e2e import rl_args

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "ds-rlhf-test/tiny-chat"


def _train_ppo(args, hub_cache: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", *args], cwd=ROOT,
                          env=clean_env(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=timeout)


def test_a_hub_id_not_in_the_cache_stops_the_run_in_one_line_before_anything_loads(tmp_path):
    empty = tmp_path / "hub"
    empty.mkdir()
    out = tmp_path / "run"
    t0 = time.time()
    proc = _train_ppo(["--model.path", "HuggingFaceTB/SmolLM2-135M-Instruct", "--run.output_dir", str(out)], empty,
                      timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert errors == [errors[0]] and errors[0].startswith(
        "error: model.path='HuggingFaceTB/SmolLM2-135M-Instruct': "), proc.stderr
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in errors[0] and str(empty) in errors[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()  # refused before the run directory, the process group or any model
    assert elapsed < 60, elapsed


@pytest.mark.slow
def test_a_model_in_a_hub_style_cache_trains_one_grpo_step_by_its_hub_id(tiny_model_path, addition_stores, tmp_path):
    cache = tmp_path / "hub"
    snapshot = place_in_hub_cache(tiny_model_path, cache, HUB_ID)
    out = tmp_path / "run"
    args = rl_args(out, HUB_ID, addition_stores, "grpo", 1, ["--model.tokenizer", HUB_ID, "--rollout.backend", "hf",
                                                              "--rl.kl_coef", "0.05"])
    proc = _train_ppo(args, cache, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"model {snapshot} ({HUB_ID})" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1]
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["path"] == HUB_ID and saved["model"]["tokenizer"] == HUB_ID
