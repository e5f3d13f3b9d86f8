"""bench/low_memory_gpu.py (the H200 figures: SFT / RM / PPO / GRPO of an 8B shape under a 24 GiB cap; it runs on
a GPU). Fast: each phase's CLI arguments parse as the trainer's config, the plan summary, failure
reasons, the nvidia-smi fallback of bench/gpu_timeline.py's sampler. Slow: `--shape tiny --phases sft,grpo` on
CPU through the real CLI, one child process per phase."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "low_memory_gpu.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    # the script imports its sibling modules (bench/low_memory_*.py) as it does when run, with bench/ on sys.path
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield _load("low_memory_gpu", SCRIPT)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def _args(bench, *argv):
    import argparse

    ns = argparse.Namespace(steps=3, cap_gb=24.0, rollout_backend="", vllm_util=None, eager=False, reward="bench",
                            extra="", phase_extra=[], workdir="/tmp/wd")
    for key, value in zip(argv[::2], argv[1::2]):
        setattr(ns, key, value)
    return ns


def test_phase_arguments_are_the_recipe_plus_valid_overrides(bench, tmp_path):
    sizes = dict(bench.RUN_SIZES["default"])
    stores = {k: tmp_path / k for k in ("sft", "preference", "prompts")}
    args = _args(bench, "reward", "rm", "extra", "--optim.weight_decay 0.01", "phase_extra",
                 ["ppo=--critic.init actor", "ppo=--rl.kl_coef 0.02", "grpo=--rl.kl_coef 0.02"],
                 "vllm_util", 0.7, "eager", True)
    for phase in ("sft", "rm", "ppo", "grpo"):
        argv = bench.phase_argv(args, phase, tmp_path / "m", stores, sizes, tmp_path / phase, True, export_rm=True)
        assert argv[0] == "--config" and "low_memory_24g" in argv[1]
        cfg = parse_config(argv, recipe=bench.PHASES[phase])  # every key is one the phase's trainer reads
        assert cfg.model.lora_rank == 16 and cfg.model.share_base and cfg.offload  # the recipe is kept
        assert cfg.run.max_gpu_memory_gb == 24 and cfg.run.steps == 3 and cfg.optim.weight_decay == 0.01
        if phase in ("ppo", "grpo"):
            assert cfg.rl.kl_coef == 0.02
            assert cfg.rl.algo == phase and cfg.rollout.max_new_tokens == sizes["new_tokens"]
            assert cfg.reward.model == "/tmp/wd/runs/rm/export" and not cfg.reward.fn
            assert cfg.rollout.gpu_memory_utilization == 0.7 and cfg.rollout.enforce_eager
            assert cfg.run.profile_memory and cfg.rollout.sleep
            assert cfg.critic.init == ("actor" if phase == "ppo" else "auto")
        else:
            assert cfg.data.train == str(stores["sft" if phase == "sft" else "preference"])
            assert cfg.run.export_hf == (phase == "rm")
    bench_reward = bench.phase_argv(_args(bench), "grpo", tmp_path, stores, sizes, tmp_path, False, False)
    cfg = parse_config(bench_reward)
    assert cfg.reward.fn.endswith("bench_rewards.py:distinct_ratio") and cfg.reward.workers == 0


def test_plan_summary_and_failure_reasons(bench, tiny_model_path):
    from ds_rlhf.memory.plan import plan_memory

    cfg = parse_config(["--config", str(ROOT / "ds_configs" / "low_memory_24g.yaml"), "--model.path",
                        str(tiny_model_path)])
    plan = plan_memory(cfg, kind="sft", device="cuda", capacity=24 << 30)

    class Done:  # what start_plan's Popen gives collect_plan
        returncode = 0

        def communicate(self, timeout):
            return "noise before the JSON\n" + json.dumps(plan.to_dict()), ""

    out = bench.collect_plan(Done())
    assert out["fits"] and out["capacity_gib"] == 24 and out["peak_gib"] == pytest.approx(plan.peak / (1 << 30))
    assert "actor" in out["roles"] and out["roles"]["actor"]["params"] > 0
    reason = bench.failure_reason
    assert reason(0, "", False) is None
    assert reason(1, "error: run.max_gpu_memory_gb=24: this rm run needs about 30 GiB", False) == "cap refused"
    assert reason(1, "torch.OutOfMemoryError: CUDA out of memory. Tried", False) == "OOM"
    assert reason(-9, "", False).startswith("killed") and reason(-15, "", True) == "timeout"
    assert reason(1, "Traceback ...", False) == "error"
    assert bench.params_of(bench.SHAPES["8b"]) == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B


def test_sampler_reads_nvidia_smi_without_pynvml(tmp_path, monkeypatch):
    """No pynvml: the sampler runs `nvidia-smi --query-gpu=memory.used,utilization.gpu -lms` and parses its lines."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do echo '2048, 37'; echo '[N/A], [N/A]'; sleep 0.05; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    timeline = _load("gpu_timeline", ROOT / "bench" / "gpu_timeline.py")
    assert timeline.parse_smi_line("81559, 100\n") == (81559 / 1024, 100.0)
    assert timeline.parse_smi_line("[N/A], [N/A]") is None
    with timeline.Sampler(0.05) as sampler:
        deadline = time.time() + 20
        while len(sampler.samples) < 3 and time.time() < deadline:
            time.sleep(0.05)
    assert sampler.source == "nvidia-smi" and sampler._proc.poll() is not None  # stopped with the sampler
    assert len(sampler.samples) >= 3 and all(s[1:] == (37.0, 2.0) for s in sampler.samples)


@pytest.mark.extended
@pytest.mark.slow
def test_low_memory_bench_tiny_on_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(SCRIPT), "--shape", "tiny", "--phases", "sft,grpo", "--steps", "2",
           "--rollout-backend", "hf", "--no-plan", "--workdir", str(work), "--out", str(out)]
    env = clean_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "low_memory.json").read_text())
    assert result == json.loads((work / "low_memory.json").read_text())
    phases = result["runs"]["tiny"]["phases"]
    assert list(phases) == ["sft", "grpo"]
    for name, r in phases.items():
        assert r["exit"] == 0 and r["ok"] and r["reason"] is None, (name, r.get("log_tail"))
        assert r["steps_logged"] == 2 and len(r["step_seconds"]) == 2 and min(r["step_seconds"]) > 0
        assert r["step_time_s"] > 0 and r["wall_s"] > r["step_time_s"] and r["host_rss_peak_gib"] > 0
        assert "low_memory_24g" in r["command"] and r["config"]["model"]["lora_rank"] == 16
        assert r["config"]["run"]["max_gpu_memory_gb"] == 24 and r["config"]["run"]["steps"] == 2
        if r["nvml_source"] is None:  # no GPU here: no NVML figures, and no verdict against the cap
            assert r["nvml_peak_gib"] is None and r["within_cap"] is None
    assert phases["grpo"]["config"]["rl"]["algo"] == "grpo" and "time/rollout" in phases["grpo"]["time_median"]
    assert any(k.startswith("memory/") for k in phases["grpo"]["profile_memory"])  # --run.profile_memory on CPU: RSS
    table = proc.stdout[proc.stdout.index("| phase |"):]
    for name in ("sft", "grpo"):
        assert f"| {name} | 0 | 2 |" in table
    for name in ("sft", "grpo"):  # each phase's log went to OUT/logs as it ran, and to the workdir when it ended
        live, kept = out / "logs" / f"{name}.log", work / "runs" / f"{name}.log"
        assert phases[name]["log"] == str(kept) and "step 2/2" in live.read_text()
        assert kept.read_text() == live.read_text() and "previous" not in phases[name]  # the placeholder was replaced


def test_a_call_stopped_mid_phase_leaves_a_placeholder_the_table_shows(bench):
    """run_phases saves a 'running' record before each phase, so a device call stopped mid-phase brings back which
    phase it was in; the markdown table prints that record instead of failing on its missing fields."""
    results = {"machine": {"gpu": None, "cpus": 2, "ram_gib": 24.0, "versions": {"torch": "x"}}, "date": "d",
               "commands": ["c"], "runs": {"8b": {"sizes": {"batch": 8, "seq_len": 512, "prompts": 8, "samples": 4,
                                                             "prompt_len": 128, "new_tokens": 256},
                                                   "cap_gb": 24, "reward": "bench", "extra": "", "params": 8e9,
                                                   "phases": {"ppo": {"phase": "ppo", "ok": False,
                                                                      "reason": "running (the call ended mid-phase)",
                                                                      "started": "2026-12-01 20:30:00 UTC"}}}}}
    table = bench.markdown(results)
    assert "| ppo | - |" in table and "running (the call ended mid-phase) (started 2026-12-01 20:30:00 UTC)" in table
