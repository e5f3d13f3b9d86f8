"""ds-rlhf bench: lists the bench/ scripts, forwards to them by path, prints a table of the JSON each writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.ops import bench as bench_cli
from ds_rlhf.ops.bench import BENCH_DIR, BENCHES, table_of
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "ds-rlhf"


def _run(*args, cwd, timeout=120):
    # clean_env: the test session's own process group holds MASTER_PORT; a child must form its own
    return subprocess.run([str(EXE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env())


def test_the_scripts_are_found_from_the_package_location():
    assert BENCH_DIR == ROOT / "bench"
    assert all((BENCH_DIR / b.script).is_file() for b in BENCHES.values())


def test_bench_help_lists_every_benchmark(tmp_path):
    out = _run("bench", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for name, bench in BENCHES.items():
        assert f"  {name}" in out.stdout and bench.script in out.stdout
    assert "bench/ is not a package" in out.stdout and "no sync-only mode" in out.stdout


def test_bench_data_help_is_the_scripts_own(tmp_path):
    out = _run("bench", "data", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--size_gib" in out.stdout and "--skip_datasets" in out.stdout  # bench/data_loading.py's argparse


def test_unknown_benchmark(tmp_path, capsys):
    assert bench_cli.main(["trian"]) == 2 and "unknown benchmark" in capsys.readouterr().err
    assert bench_cli.main([]) == 2


def test_tables_of_each_scripts_json():
    rollout = {"meta": {}, "results": {
        "0.5b": {"sync": {"bucket_1024MiB": {"bytes": 988e6, "buckets": 1, "seconds_median": 0.1, "gbps_median": 9.88,
                                             "canary_after_sync": 0.01}},
                 "generate": {"tokens_per_s_best": {"ours": 9000.0, "plain_logprobs": 9100.0,
                                                    "plain_no_logprobs": 9500.0},
                              "ratio_ours_vs_plain_logprobs": 0.989},
                 "sleep": {"level1": {"freed_gb": 30.1, "seconds": 0.4}}},
        "1.5b": {"shape": "1.5b", "error": "child exited 1"}}}
    text = table_of("rollout", rollout)
    assert "9000" in text and "0.989" in text and "child exited 1" in text
    text = table_of("sync", rollout)
    assert "1024MiB" in text and "9.88" in text and "0.988" in text
    engines = [{"config": "zero2", "tokens_per_s": 144.1, "tflops": 0.1, "step_s": 0.9, "peak_mem_bytes": 2**30,
                "peak_mem_kind": "process peak RSS", "device": "cpu"}, {"config": "zero3", "error": "exit 1"}]
    text = table_of("engines", engines)
    assert "zero2" in text and "144.1" in text and "exit 1" in text
    data = {"summary": [{"method": "scan mmap", "temp": "cold", "gbps_median": 1.5, "gbps_min": 1.2, "gbps_max": 1.7,
                         "samples_s_median": 1000.0, "reader": "mmap"}]}
    assert "scan mmap" in table_of("data", data) and "1.20-1.70" in table_of("data", data)
    rl = {"tag": "0.5b-grpo", "steps": 22, "completions_per_s": 110.0, "median": {"time/rollout": 1.2},
          "mfu": {"mfu": 0.21, "train_tflops": 166.0}, "gpu": {"util_mean": 91.0}}
    text = table_of("rl-step", rl)
    assert "completions_per_s" in text and "median time/rollout" in text and "mfu/mfu" in text
    assert table_of("data", {"summary": [{"method": "x"}]}).startswith("(no table")


@pytest.mark.extended
@pytest.mark.slow
def test_bench_engines_tiny_writes_json_and_prints_a_table(tmp_path):
    out = _run("bench", "engines", "--tiny", "--steps", "1", "--warmup", "0", "--configs", "zero2", "--json-out",
               str(tmp_path / "res" / "engines.json"), cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "res" / "engines.json").read_text())
    assert rows[0]["config"] == "zero2" and rows[0]["tokens_per_s"] > 0
    assert "tokens/s" in out.stdout and "peak GiB" in out.stdout
