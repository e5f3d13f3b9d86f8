"""bench/vllm_plain_gpu.py (plain `LLM.generate` tokens/s with the rollout's engine options; the lead runs it on the
H200). Fast: its engine arguments and its measurement on the session's vLLM engine. Slow: the whole `--tiny` CLI in
a fresh process (a vLLM start on CPU alone takes longer than a fast test may)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vllm_plain_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_plain_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_arguments_carry_the_options(bench):
    args = bench.parse_args(["--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--async-scheduling",
                             "true", "--cudagraph-sizes", "8,16"])
    kw = bench.llm_kwargs(args, "/m", cpu=False, version="0.26.0")
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["async_scheduling"], kw["cudagraph_capture_sizes"],
            kw["logprobs_mode"], kw["gpu_memory_utilization"], kw["max_model_len"]) == (
        256, 8192, True, [8, 16], "processed_logprobs", 0.35, 128 + 256)
    default = bench.llm_kwargs(bench.parse_args([]), "/m", cpu=False, version="0.26.0")
    assert not {"max_num_seqs", "max_num_batched_tokens", "async_scheduling", "cudagraph_capture_sizes"} & set(default)


def test_measure_on_the_session_engine(bench, vllm_colocated):
    args = bench.parse_args(["--tiny", "--temperature", "0.7"])
    prompts = [[1, 5, 6, 7 + i] for i in range(args.prompts)]
    params = bench.sampling_params(args, len(prompts))
    assert params[1].seed == 1234 + args.samples and params[0].n == args.samples and params[0].logprobs == 0
    out = bench.measure(vllm_colocated.handle.llm, prompts, params, repeats=1)
    (run,) = out["runs"]
    assert run["tokens"] == args.prompts * args.samples * args.new_tokens  # ignore_eos: every response is full
    assert out["tokens_per_s_best"] == run["tokens_per_s"] > 0


def test_profile_on_the_session_engine(bench, vllm_colocated):
    """--profile: the host functions of one generate call by own time (vLLM's engine step among them)."""
    args = bench.parse_args(["--tiny"])
    prompts = [[1, 5, 6, 7 + i] for i in range(args.prompts)]
    out = bench.profile_call(vllm_colocated.handle.llm, prompts, bench.sampling_params(args, len(prompts)), top=40)
    host = out["host"]
    assert host["wall_seconds_profiled"] > 0 and len(host["top_own_time"]) == 40
    own = [r["own_s"] for r in host["top_own_time"]]
    assert own == sorted(own, reverse=True) and all(r["calls"] >= 1 for r in host["top_own_time"])
    assert "gpu" not in out  # CPU machine: no CUDA section


@pytest.mark.extended
@pytest.mark.slow
def test_plain_bench_runs_tiny_on_cpu(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--tag", "t",
           "--workdir", str(tmp_path / "work"), "--max-num-seqs", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "vllm_plain_t.json").read_text())
    assert result["effective_options"]["max_num_seqs"] == 64
    assert result["effective_options"]["logprobs_mode"] == "processed_logprobs"
    assert result["tokens_per_s_best"] > 0 and result["runs"][0]["tokens"] == 4 * 2 * 16


def test_sweep_script_dry_run(tmp_path):
    """bench/rollout_options_gpu.sh: the commands of a sweep (DRY=1 prints them), unknown runs refused."""
    import os

    script = ROOT / "bench" / "rollout_options_gpu.sh"
    env = dict(os.environ, DRY="1", PLAIN="1", OUT=str(tmp_path / "out"))

    def dry(*names):
        return subprocess.run(["bash", str(script), *names], capture_output=True, text=True, env=env, timeout=60)

    proc = dry("baseline", "temp07", "seqs256")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert lines[:4] == [
        f"+ python3 rl_step_gpu.py --steps 8 --micro-batch-tokens 32768 --out {tmp_path / 'out'} --tag opt_baseline",
        f"+ python3 vllm_plain_gpu.py --out {tmp_path / 'out'} --tag plain_baseline",
        f"+ python3 rl_step_gpu.py --steps 8 --micro-batch-tokens 32768 --out {tmp_path / 'out'} --tag opt_temp07 "
        "--cfg rollout.temperature=0.7",
        f"+ python3 vllm_plain_gpu.py --out {tmp_path / 'out'} --tag plain_temp07 --temperature 0.7"]
    assert lines[4].endswith("--tag opt_seqs256 --cfg rollout.max_num_seqs=256")
    assert lines[5].endswith("--tag plain_seqs256 --max-num-seqs 256")
    assert not (tmp_path / "out").exists()
    bad = dry("nope")
    assert bad.returncode == 2 and "unknown run 'nope'" in bad.stderr
