"""bench/engines_gpu.py must run end to end; here on CPU with --tiny (the lead runs the 0.5B shape on the H200)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.extended
@pytest.mark.slow
def test_engines_bench_tiny_on_cpu(tmp_path):
    out = tmp_path / "engines.json"
    cmd = [sys.executable, str(ROOT / "bench" / "engines_gpu.py"), "--tiny", "--warmup", "1", "--steps", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["config"] for r in results] == ["zero2", "zero3", "zero3_offload"]
    for r in results:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_mem_bytes"] > 0
        assert r["batch"] * r["seq"] == 2 * 64 and r["timed_steps"] == 2
        assert r["tflops"] == pytest.approx(6 * r["params"] * r["tokens_per_s"] / 1e12)
