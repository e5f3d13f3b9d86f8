"""The learning benchmark's results (`bench/learn_results.py`, `bench/learn_seeds.py`): the curve and the GPU use of
a run, `--merge` of runs made apart, and `--seeds N`: each run's run.seed, the median, the band and the time to each
exact match, seeds run at once, and a tiny seeds run end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds_rlhf.testing.multiproc import clean_env
from tests.ops.learn_bench import CALCULATOR, bench_module


def test_gpu_use_averages_the_samples_taken_over_the_training_steps(monkeypatch):
    results = bench_module(monkeypatch, "learn_results")
    metrics = [{"step": 0, "time": 100.0, "eval/pass@1": 0.0}, {"step": 1, "time": 110.0}, {"step": 2, "time": 120.0}]
    samples = [(105.0, 0.0, 5.0), (110.0, 40.0, 30.0), (115.0, 60.0, 35.0), (120.0, 80.0, 33.0), (125.0, 0.0, 50.0)]
    out = results.gpu_use(samples, "nvml", metrics)  # the engine start-up (105) and the exit (125) are left out
    assert out == {"source": "nvml", "window": [110.0, 120.0], "gpu_util_mean": 60.0, "gpu_mem_max_gib": 35.0,
                   "samples": 3}
    assert results.gpu_use([], None, metrics)["gpu_util_mean"] is None


def test_the_curve_records_each_steps_staleness(monkeypatch):
    """rollout.max_staleness 2: each step's staleness in `lengths`, their mean and maximum in the summary."""
    results = bench_module(monkeypatch, "learn_results")
    ages = [0, 1, 2, 1]
    history = [{"step": i + 1, "time/wall": 1.0, "throughput/completions_per_s": 8.0, "rollout/staleness": a,
                "rollout/staleness_mean": a, "rollout/staleness_max": a} for i, a in enumerate(ages)]
    run = results.curve(history)
    assert [x["staleness_max"] for x in run["lengths"]] == [x["staleness_mean"] for x in run["lengths"]] == ages
    assert run["summary"]["staleness_mean"] == 1.0 and run["summary"]["staleness_max"] == 2
    assert results.curve([{"step": 1, "time/wall": 1.0, "throughput/completions_per_s": 8.0}])["summary"].keys() \
        .isdisjoint({"staleness_mean", "staleness_max"})  # metrics without staleness: none made up


def test_merge_keeps_the_warm_start_step0_of_every_run(tmp_path, monkeypatch):
    """Runs of one mode each (`--modes sync`, `--modes async`), each with its own warm start, joined by --merge:
    the step-0 figures after SFT of both modes stay in `warm_start`."""
    results = bench_module(monkeypatch, "learn_results")
    files = []
    for i, mode in enumerate(("sync", "async")):
        point = {"step": 0, "seconds": 0.0, "generated_tokens": 0, "exact_match": i / 4, "format": None,
                 "tool_call_rate": i / 2, "turns_mean": 1.0 + i}
        run = {"points": [point], "lengths": [], "summary": {}}
        data = {"task": "arithmetic", "model_name": "m", "device": "CPU", "settings": {"environment": CALCULATOR},
                "modes": {mode: run}, "warm_start": {"steps": 3, "step0": {mode: {"exact_match": i / 4,
                                                                                  "tool_call_rate": i / 2}}}}
        files.append(tmp_path / f"{mode}.json")
        files[-1].write_text(json.dumps(data))
    merged = json.loads(results.merge(files, tmp_path).read_text())
    assert list(merged["modes"]) == ["sync", "async"] and merged["warm_start"]["steps"] == 3
    assert merged["warm_start"]["step0"] == {"sync": {"exact_match": 0.0, "tool_call_rate": 0.0},
                                             "async": {"exact_match": 0.25, "tool_call_rate": 0.5}}


def test_merge_labels_keep_two_runs_of_one_mode_apart(tmp_path, monkeypatch):
    """Two synchronous runs with different settings, joined with --labels: both curves stay, each named by its label;
    a label count that does not match the files is refused in one line."""
    learn, results = bench_module(monkeypatch), bench_module(monkeypatch, "learn_results")
    files = []
    for i, label in enumerate(("whole", "partial")):
        point = {"step": 0, "seconds": 0.0, "generated_tokens": 0, "exact_match": i / 4, "format": None}
        data = {"task": "arithmetic", "model_name": "m", "device": "CPU", "settings": {},
                "modes": {"sync": {"points": [point], "lengths": [], "summary": {}}}}
        files.append(tmp_path / f"{label}.json")
        files[-1].write_text(json.dumps(data))
    merged = json.loads(results.merge(files, tmp_path, ["whole", "partial"]).read_text())
    assert list(merged["modes"]) == ["sync, whole", "sync, partial"]
    assert merged["modes"]["sync, partial"]["points"][0]["exact_match"] == 0.25
    with pytest.raises(SystemExit):
        learn.parse_args(["--merge", str(files[0]), str(files[1]), "--labels", "whole"])


def _run(points: list[tuple[int, float, float]]) -> dict:
    """A learn_results.curve() result from (step, seconds, exact match) evaluation points."""
    pts = [{"step": st, "seconds": sec, "exact_match": em} for st, sec, em in points]
    return {"points": pts, "summary": {"steps": pts[-1]["step"], "train_seconds": pts[-1]["seconds"]}}


def test_seeds_aggregate_the_median_the_band_and_the_time_to_each_exact_match(monkeypatch):
    seeds = bench_module(monkeypatch, "learn_seeds")
    runs = {0: _run([(0, 0, 0.1), (10, 20, 0.2), (20, 40, 0.3), (30, 60, 0.6)]),
            1: _run([(0, 0, 0.1), (10, 30, 0.16), (20, 60, 0.05), (30, 90, 0.45)]),  # dips at step 20
            2: _run([(0, 0, 0.1), (10, 10, 0.3), (20, 20, 0.28)]),  # stopped after step 20
            3: "learn: `ds-rlhf train-ppo` failed (exit 1)"}
    agg = seeds.aggregate(runs)
    assert agg["seeds"] == [0, 1, 2, 3] and agg["failed"] == {3: runs[3]} and set(agg["per_seed"]) == {0, 1, 2}
    assert agg["by_step"] == [{"step": 0, "n": 3, "median": 0.1, "min": 0.1, "max": 0.1},
                              {"step": 10, "n": 3, "median": 0.2, "min": 0.16, "max": 0.3},
                              {"step": 20, "n": 3, "median": 0.28, "min": 0.05, "max": 0.3},
                              {"step": 30, "n": 2, "median": pytest.approx(0.525), "min": 0.45, "max": 0.6}]
    t15, t25, t50 = (agg["time_to"][x] for x in ("15%", "25%", "50%"))
    assert t15["per_seed"] == {0: {"seconds": 20, "step": 10}, 1: {"seconds": 30, "step": 10},
                               2: {"seconds": 10, "step": 10}}
    assert (t15["median_seconds"], t15["median_step"], t15["reached"]) == (20, 10, 3)
    assert [t25["per_seed"][s]["seconds"] for s in (0, 1, 2)] == [40, 90, 10] and t25["median_seconds"] == 40
    # 50 %: one seed of three got there; the median counts the others as never
    assert t50["reached"] == 1 and t50["median_seconds"] is None and t50["per_seed"][2]["seconds"] is None
    assert agg["per_seed"][1]["dips"] == [{"step": 20, "exact_match": 0.05, "before": 0.16}]
    assert agg["per_seed"][0]["dips"] == [] and agg["per_seed"][2] == {"end": 0.28, "best": 0.3, "steps": 20,
                                                                        "train_seconds": 20, "dips": []}
    # against seconds: each seed interpolated inside its own run; at 45 s seed 2 (20 s long) is out
    at = {row["seconds"]: row for row in agg["by_seconds"]}
    assert at[45.0]["n"] == 2 and at[45.0]["median"] == pytest.approx((0.375 + 0.105) / 2)
    assert at[0.0] == {"seconds": 0.0, "n": 3, "median": 0.1, "min": 0.1, "max": 0.1} and max(at) == 90


def test_seed_settings_and_each_runs_run_seed(tmp_path, monkeypatch):
    learn = bench_module(monkeypatch)
    stores = {"train": tmp_path / "train", "heldout": tmp_path / "heldout"}
    one = learn.parse_args(["--tiny"])
    assert one.seeds == 1 and one.seed_values == []  # one run per mode, the trainer's own run.seed
    assert "--run.seed" not in learn.trainer_args(one, "tiny", stores, tmp_path, "sync", False)
    assert learn.parse_args(["--tiny", "--seeds", "3"]).seed_values == [0, 1, 2]
    assert learn.parse_args(["--tiny", "--seed-list", "4,9"]).seed_values == [4, 9]
    cfg = learn.trainer_args(learn.parse_args(["--tiny", "--seeds", "2", "--cfg", "rl.algo=dr_grpo"]), "tiny",
                             stores, tmp_path, "sync", False, seed=1)
    assert cfg[cfg.index("--run.seed") + 1] == "1" and cfg[-2:] == ["--rl.algo", "dr_grpo"]
    for flags in (["--seeds", "2", "--cfg", "run.seed=3"], ["--seeds", "0"], ["--seed-list", "1,x"],
                  ["--seed-list", "2,2"], ["--concurrent", "0"]):
        with pytest.raises(SystemExit):
            learn.parse_args(["--tiny", *flags])


def test_concurrent_seeds_run_together_staggered_and_a_failure_leaves_the_others(monkeypatch):
    seeds = bench_module(monkeypatch, "learn_seeds")
    import threading
    import time

    together, starts = threading.Barrier(2, timeout=60), {}

    def one(job):
        starts[job] = time.monotonic()
        if job[1] == 2:
            raise SystemExit("learn: `ds-rlhf train-ppo` failed (exit 1)")
        if job[1] < 2:
            together.wait()  # seeds 0 and 1 run at the same time, or this times out
        return {"job": job}

    done = seeds.run_jobs([("sync", 0), ("sync", 1), ("sync", 2)], one, concurrent=2, stagger=0.3)
    assert done == {("sync", 0): {"job": ("sync", 0)}, ("sync", 1): {"job": ("sync", 1)},
                    ("sync", 2): "learn: `ds-rlhf train-ppo` failed (exit 1)"}
    order = sorted(starts.values())
    assert all(b - a >= 0.29 for a, b in zip(order, order[1:]))  # the starts `stagger` apart


@pytest.mark.slow  # in CI: two seeds of one step, run at the same time
def test_tiny_seeds_run_writes_each_seeds_curve_the_band_and_time_to(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", "bench", "learn", "--tiny", "--modes", "sync",
                          "--seeds", "2", "--steps", "1", "--eval-size", "4", "--concurrent", "2", "--stagger", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=clean_env(), cwd=tmp_path,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "learn_arithmetic.json").read_text())
    assert list(result["modes"]) == ["sync, seed 0", "sync, seed 1"]
    for seed in (0, 1):
        run = result["modes"][f"sync, seed {seed}"]
        assert [p["step"] for p in run["points"]] == [0, 1] and run["summary"]["steps"] == 1
        config = json.loads((tmp_path / "work_arithmetic" / f"run_sync_seed{seed}" / "config.json").read_text())
        assert config["run"]["seed"] == seed
    agg = result["seeds"]["sync"]
    assert agg["seeds"] == [0, 1] and agg["failed"] == {} and set(agg["per_seed"]) == {"0", "1"}
    assert [(r["step"], r["n"]) for r in agg["by_step"]] == [(0, 2), (1, 2)]
    assert all(r["min"] <= r["median"] <= r["max"] for r in agg["by_step"] + agg["by_seconds"])
    assert set(agg["time_to"]) == {"15%", "25%", "50%"}
    assert all(set(t["per_seed"]) == {"0", "1"} for t in agg["time_to"].values())
    assert (tmp_path / "learn_arithmetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "median training seconds to" in out.stdout


def test_merge_joins_seed_runs_of_one_mode_each(tmp_path, monkeypatch):
    """--seeds runs of sync and async made apart (one per call), joined by --merge: both modes' runs and aggregates,
    and the seeds' PNG; with --labels each mode's name carries its label."""
    results, seeds = bench_module(monkeypatch, "learn_results"), bench_module(monkeypatch, "learn_seeds")
    files = []
    for i, mode in enumerate(("sync", "async")):
        runs = {s: _run([(0, 0, 0.1), (10, 20 + s, 0.2 + i / 10 + s / 100)]) for s in (0, 1)}
        data = {"task": "arithmetic", "model_name": "m", "device": "CPU", "settings": {},
                "modes": {f"{mode}, seed {s}": run for s, run in runs.items()},
                "seeds": {mode: seeds.aggregate(runs)}}
        files.append(tmp_path / f"{mode}.json")
        files[-1].write_text(json.dumps(data))
    merged = json.loads(results.merge(files, tmp_path).read_text())
    assert list(merged["modes"]) == ["sync, seed 0", "sync, seed 1", "async, seed 0", "async, seed 1"]
    assert merged["seeds"]["async"]["by_step"][1]["median"] == pytest.approx(0.305)
    assert (tmp_path / "learn_arithmetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labelled = json.loads(results.merge(files, tmp_path, ["a", "b"]).read_text())
    assert list(labelled["seeds"]) == ["sync, a", "async, b"] and "async, b, seed 1" in labelled["modes"]


def test_merge_pools_one_modes_seeds_from_several_bench_runs(tmp_path, monkeypatch):
    """Seeds of one mode from two bench runs on different days (0-1, then 2 and a failed 3), joined by --merge: one
    aggregate over all four, each seed's file, date and device in `sources`; the same seed twice is one error line."""
    results, seeds = bench_module(monkeypatch, "learn_results"), bench_module(monkeypatch, "learn_seeds")
    files = []
    for day, listed in (("2026-12-07", (0, 1)), ("2026-12-08", (2, 3))):
        runs = {s: _run([(0, 0, 0.1), (10, 20 + 10 * s, 0.2 + s / 10)]) for s in listed}
        if 3 in runs:
            runs[3] = "learn: `ds-rlhf train-ppo` failed (exit 1)"
        data = {"task": "arithmetic", "model_name": "m", "device": "H200", "date": day, "settings": {},
                "modes": {f"sync, seed {s}": run for s, run in runs.items() if isinstance(run, dict)},
                "seeds": {"sync": seeds.aggregate(runs)}}
        files.append(tmp_path / f"{day}.json")
        files[-1].write_text(json.dumps(data))
    merged = json.loads(results.merge(files, tmp_path).read_text())
    agg = merged["seeds"]["sync"]
    assert agg["seeds"] == [0, 1, 2, 3] and list(agg["failed"]) == ["3"] and set(agg["per_seed"]) == {"0", "1", "2"}
    assert agg["time_to"]["25%"]["median_seconds"] == 40 and agg["time_to"]["25%"]["reached"] == 2  # seed 0: never
    assert [agg["sources"][s]["date"] for s in "0123"] == ["2026-12-07"] * 2 + ["2026-12-08"] * 2
    assert agg["sources"]["2"]["file"] == str(files[1])
    assert list(merged["modes"]) == ["sync, seed 0", "sync, seed 1", "sync, seed 2"]
    with pytest.raises(SystemExit, match=r"^error: --merge: sync seed 2 is in two files .*--labels keeps them apart"):
        results.merge([files[0], files[1], files[1]], tmp_path)


def test_each_finished_run_is_written_before_the_next_starts(tmp_path, monkeypatch):
    """--seeds writes learn_<task>.json after every run, so a run cut short (a time limit, a lost machine) leaves the
    runs that finished on disk with their aggregate."""
    seeds = bench_module(monkeypatch, "learn_seeds")
    out = tmp_path / "learn_arithmetic.json"
    seen = []

    def run_one(mode, seed):
        seen.append(json.loads(out.read_text()) if out.exists() else None)
        if seed == 1:
            raise SystemExit("learn: `ds-rlhf train-ppo` failed (exit 1)")
        return _run([(0, 0, 0.1), (10, 20, 0.3)])

    args = type("Args", (), {"modes": ["sync"], "seed_values": [0, 1, 2], "concurrent": 1, "stagger": 0.0,
                             "cfg": [], "out": tmp_path, "task": "arithmetic"})()
    assert seeds.run_seeds(args, {"task": "arithmetic", "model_name": "m", "device": "CPU"}, run_one) == 1
    assert seen[0] is None and list(seen[1]["modes"]) == ["sync, seed 0"] and seen[1]["seeds"]["sync"]["seeds"] == [0]
    assert seen[2]["seeds"]["sync"]["seeds"] == [0, 1] and "1" in seen[2]["seeds"]["sync"]["failed"]
    final = json.loads(out.read_text())
    assert final["seeds"]["sync"]["seeds"] == [0, 1, 2] and (tmp_path / "learn_arithmetic.png").exists()
