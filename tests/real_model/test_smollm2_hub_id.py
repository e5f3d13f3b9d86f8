"""SmolLM2-135M-Instruct by its Hub id, as a TRL / OpenRLHF / verl user types it: the converted model placed in a
Hub-style cache (offline, as the tests run) starts a GRPO run under `HuggingFaceTB/SmolLM2-135M-Instruct`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.hub_cache import place_in_hub_cache
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_the_converted_model_by_its_hub_id_runs_a_grpo_step(smollm2_path, smollm2_gsm8k_store, tmp_path):
    cache = tmp_path / "hub"
    snapshot = place_in_hub_cache(smollm2_path, cache, HUB_ID)
    out = tmp_path / "run"
    args = ["--model.path", HUB_ID, "--data.train", str(smollm2_gsm8k_store), "--run.output_dir", str(out),
            "--run.steps", "1", "--rl.algo", "grpo", "--reward.fn", "gsm8k", "--rl.prompts_per_step", "2",
            "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8", "--rollout.backend", "hf",
            "--data.max_prompt_len", "320", "--optim.micro_batch_size", "4", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.export_hf", "false"]
    proc = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", *args], cwd=ROOT,
                          env=clean_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"model {snapshot} ({HUB_ID})" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1]
