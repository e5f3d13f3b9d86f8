"""`run.deterministic`: two runs of one command give the same metrics and weights; what the mode sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ds_rlhf.config import parse_config
from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.recipes import rl_service
from ds_rlhf.run.determinism import configure_determinism, forced_settings
from ds_rlhf.telemetry.logger import read_metrics
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
# wall-clock and host figures: not a function of the computation
TIMING_PREFIXES = ("time", "throughput/", "sys/", "memory/", "perf/", "health/")
TIMING_PARTS = ("seconds", "_per_s", "gbps", "rss")


def _computed(key: str) -> bool:
    return not key.startswith(TIMING_PREFIXES) and not any(part in key for part in TIMING_PARTS)


def _run(out: Path, model: Path, store: Path, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A 3-step PPO run of the tiny model (HF generate rollouts) in a fresh process; its metrics and exported
    actor weights."""
    args = ["--model.path", str(model), "--data.train", str(store), "--reward.fn", "math_shaped",
            "--rl.algo", "ppo", "--run.output_dir", str(out), "--run.steps", "3", "--rl.prompts_per_step", "4",
            "--rollout.n_samples", "4", "--rollout.max_new_tokens", "8", "--rollout.backend", "hf",
            "--optim.lr", "1e-3", "--optim.critic_lr", "1e-3", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.export_hf", "true", *extra]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train_ppo.py"), *args], cwd=ROOT,
                          env=clean_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [{k: v for k, v in row.items() if _computed(k)} for row in read_metrics(out)]
    weights = {}
    for path in sorted((out / "export").glob("*/*.safetensors")):  # actor/ and critic/
        weights.update({f"{path.parent.name}.{k}": v for k, v in load_file(str(path)).items()})
    assert metrics and weights, (out, proc.stdout[-2000:])
    return metrics, weights


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_deterministic_runs_are_bit_identical_and_the_seed_matters(tiny_model_path, tmp_path):
    store = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=32, n_sft=4, n_pref=4, seed=0,
                                    max_operand=9)["prompts"]
    on = ("--run.deterministic", "true")
    m1, w1 = _run(tmp_path / "a", tiny_model_path, store, *on)
    m2, w2 = _run(tmp_path / "b", tiny_model_path, store, *on)
    assert m1 == m2
    # setup_run applied the mode: the saved config holds the forced per-request seeding
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["run"]["deterministic"] and saved["rollout"]["seeding"] == "request"
    assert _same_weights(w1, w2)
    start = load_file(str(next(tiny_model_path.glob("*.safetensors"))))
    assert any(not torch.equal(w1[f"actor.{k}"], v) for k, v in start.items() if f"actor.{k}" in w1), "no training"
    # another run.seed samples other responses: the comparison above can tell runs apart
    m3, w3 = _run(tmp_path / "c", tiny_model_path, store, *on, "--run.seed", "1")
    assert m3 != m1 and not _same_weights(w1, w3)


def test_deterministic_mode_forces_request_seeding_and_synchronous_rollouts():
    cfg = parse_config(["--run.deterministic", "true", "--rollout.async_generation", "true",
                        "--rl.mismatch", "tis"], recipe="train-ppo")
    notes = forced_settings(cfg)
    assert (cfg.rollout.seeding, cfg.rollout.async_generation, cfg.rollout.overlap_sync) == ("request", False, False)
    assert len(notes) == 3 and all(n.startswith("[deterministic] rollout.") for n in notes)
    assert forced_settings(cfg) == []


def test_configure_determinism_sets_torch_and_leaves_runs_without_it_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    off = parse_config([], recipe="train-ppo")
    assert configure_determinism(off) == [] and not torch.are_deterministic_algorithms_enabled()
    assert off.rollout.seeding == "batch" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        configure_determinism(parse_config(["--run.deterministic", "true"], recipe="train-ppo"))
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def test_request_seeds_follow_run_seed_step_rank_prompt_and_sample(monkeypatch):
    monkeypatch.setattr(rl_service, "run_stop_token_ids", lambda ctx: ())

    def seeds(run_seed, step, rank=0):
        cfg = parse_config(["--run.seed", str(run_seed), "--rollout.n_samples", "4", "--rollout.seeding", "request"],
                           recipe="train-ppo")
        ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(world_size=2, rank=rank))
        spec = rl_service.sampling_spec(ctx, step)
        assert spec.seeding == "request"
        # prompt i's sample j: request_seed(i) + j, one distinct seed per (prompt, sample)
        return [spec.request_seed(i) + j for i in range(8) for j in range(spec.n)]

    base = seeds(0, 1)
    assert len(set(base)) == len(base) and base == seeds(0, 1)
    assert base[5] == base[0] + 5  # prompt 1's sample 1, with n = 4
    others = [seeds(1, 1), seeds(0, 2), seeds(0, 1, rank=1)]
    assert all(set(base).isdisjoint(o) for o in others)
