"""bench/vllm_engines_gpu.py (plain vLLM engines sharing one GPU, the batch split over N of them; the lead runs it
on the H200): its argument checks, and the whole `--tiny` CLI on CPU in a fresh process (two engine processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vllm_engines_gpu.py"


def _run(tmp_path, *extra, timeout=900):
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--tag", "t",
           "--workdir", str(tmp_path / "work"), *extra]
    env = clean_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_engine_counts_are_checked_before_any_engine_starts(tmp_path):
    proc = _run(tmp_path, "--engines", "1,8", "--max-engines", "2", timeout=300)
    assert proc.returncode == 2 and "must be >= 1 and <= --max-engines 2" in proc.stderr
    proc = _run(tmp_path, "--engines", "8", timeout=300)  # --tiny has 4 prompts
    assert proc.returncode == 2 and "fewer than 8 engines" in proc.stderr


@pytest.mark.extended
@pytest.mark.slow
def test_engines_bench_runs_tiny_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    proc = _run(tmp_path, "--engines", "1,2", "--max-engines", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "vllm_engines_t.json").read_text())
    for n in ("1", "2"):
        (round_,) = result["per_engines"][n]["rounds"]  # --tiny: one timed round
        assert round_["tokens"] == 4 * 2 * 16  # every prompt generated once, whatever the split (ignore_eos)
        assert len(round_["per_engine_seconds"]) == int(n) and round_["tokens_per_s"] > 0
