"""Seeds for the learning benchmark (`bench/learn.py --seeds N`): run each mode once per `run.seed`, several runs at
once if asked, and sum the runs up.

- `seed_list`: `--seed-list 3,7` or 0 .. N-1 for `--seeds N`;
- `run_jobs`: the runs, up to `concurrent` at a time (separate trainer processes, each start `stagger` seconds after
  the one before, so their engines' start-ups do not coincide); a run that fails is recorded, the others go on;
- `aggregate`: per mode the per-step median and min/max of the held-out exact match over the seeds that reached that
  evaluation (`by_step`), the same against training seconds on a common grid (`by_seconds`: each seed's curve
  interpolated linearly inside its own range), and per seed and as the median the training seconds and the step
  to the first evaluation at X = 15, 25, 50 % exact match (`time_to`; None where not reached: the median counts
  such a seed as never, so it is None when half the seeds or more did not get there), each seed's end and best
  exact match and its dips (evaluations after step 10 below half the one before);
- `merge_into`: `learn.py --merge` of --seeds results (one mode per call, or a mode's seeds from several bench runs,
  pooled);
- `plot`: `learn_<task>.png`: per mode every seed's curve (thin), the median (thick) and the min/max band, against
  training seconds and against steps.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ds_rlhf.atomic_files import write_text_atomic

THRESHOLDS = (0.15, 0.25, 0.50)  # held-out exact match for time_to
DIP_AFTER_STEP = 10  # dips: evaluations after this step that fall below half the one before
SECONDS_GRID = 50  # points of the by-seconds median


def seed_list(seeds: int, listed: str) -> list[int]:
    """`listed` ("3,7,11") when given, else 0 .. seeds-1; a bad list is one `error:` line."""
    if not listed:
        return list(range(seeds))
    try:
        out = [int(s) for s in listed.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"error: --seed-list: give comma-separated integers, got {listed!r}") from None
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise SystemExit(f"error: --seed-list: give distinct seeds >= 0, got {listed!r}")
    return out


def run_jobs(jobs: list, fn: Callable, concurrent: int = 1, stagger: float = 0.0,
             on_done: Callable[[dict], None] | None = None) -> dict:
    """`fn(job)` for each job, up to `concurrent` at once, the starts at least `stagger` seconds apart. Returns
    {job: fn's result, or the SystemExit's message of a run that failed (a str)}; `on_done(finished so far)` after
    each job (one call at a time)."""
    lock, last, finished, report = threading.Lock(), [float("-inf")], {}, threading.Lock()

    def one(job):
        if concurrent > 1 and stagger > 0:
            with lock:  # one start at a time, `stagger` seconds after the one before
                time.sleep(max(0.0, last[0] + stagger - time.monotonic()))
                last[0] = time.monotonic()
        try:
            out = fn(job)
        except SystemExit as exc:
            print(f"learn: {job}: failed: {str(exc.code)[:400]}", flush=True)
            out = str(exc.code)
        with report:
            finished[job] = out
            if on_done is not None:
                on_done(dict(finished))
        return out

    with ThreadPoolExecutor(max_workers=max(1, concurrent)) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))


def time_to(points: list[dict], threshold: float) -> dict:
    """The training seconds and step of the first evaluation at `threshold` exact match or above (None: never)."""
    hit = next((p for p in points if p["exact_match"] >= threshold), None)
    return {"seconds": hit["seconds"] if hit else None, "step": hit["step"] if hit else None}


def _median_or_none(values: list) -> float | None:
    """The median, a None counting as never (above every number); None when the median itself is never."""
    ranked = sorted(values, key=lambda v: (v is None, v or 0.0))
    if not ranked:
        return None
    mid = len(ranked) // 2
    if len(ranked) % 2:
        return ranked[mid]
    low, high = ranked[mid - 1], ranked[mid]
    return None if low is None or high is None else (low + high) / 2


def dips(points: list[dict]) -> list[dict]:
    """Evaluations after DIP_AFTER_STEP whose exact match is below half of the evaluation before it."""
    return [{"step": b["step"], "exact_match": b["exact_match"], "before": a["exact_match"]}
            for a, b in zip(points, points[1:])
            if b["step"] > DIP_AFTER_STEP and b["exact_match"] < a["exact_match"] / 2]


def by_step(curves: dict[int, list[dict]]) -> list[dict]:
    steps = sorted({p["step"] for pts in curves.values() for p in pts})
    out = []
    for step in steps:
        values = [p["exact_match"] for pts in curves.values() for p in pts if p["step"] == step]
        out.append({"step": step, "n": len(values), "median": statistics.median(values), "min": min(values),
                    "max": max(values)})
    return out


def _interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            span = xs[i] - xs[i - 1]
            return ys[i] if span <= 0 else ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / span
    return ys[-1]


def by_seconds(curves: dict[int, list[dict]]) -> list[dict]:
    """Median and min/max on a grid from 0 to the longest run's seconds, over the seeds whose run covers the point."""
    end = max((pts[-1]["seconds"] for pts in curves.values() if pts), default=0.0)
    out = []
    for i in range(SECONDS_GRID + 1) if end > 0 else ():
        x = end * i / SECONDS_GRID
        values = [v for pts in curves.values()
                  if (v := _interp(x, [p["seconds"] for p in pts], [p["exact_match"] for p in pts])) is not None]
        if values:
            out.append({"seconds": round(x, 2), "n": len(values), "median": statistics.median(values),
                        "min": min(values), "max": max(values)})
    return out


def aggregate(runs: dict[int, dict | str]) -> dict:
    """One mode's seeds: {seed: learn_results.curve() result, or the failure message}."""
    curves = {s: r["points"] for s, r in runs.items() if isinstance(r, dict)}
    per_seed = {s: {"end": pts[-1]["exact_match"] if pts else None,
                    "best": max((p["exact_match"] for p in pts), default=None),
                    "steps": runs[s]["summary"]["steps"], "train_seconds": runs[s]["summary"]["train_seconds"],
                    "dips": dips(pts)} for s, pts in curves.items()}
    time_to_x = {}
    for x in THRESHOLDS:
        each = {s: time_to(pts, x) for s, pts in curves.items()}
        time_to_x[f"{round(100 * x)}%"] = {"per_seed": each, "reached": sum(v["seconds"] is not None
                                                                            for v in each.values()),
                                           "median_seconds": _median_or_none([v["seconds"] for v in each.values()]),
                                           "median_step": _median_or_none([v["step"] for v in each.values()])}
    return {"seeds": list(runs), "failed": {s: r for s, r in runs.items() if isinstance(r, str)},
            "per_seed": per_seed, "time_to": time_to_x, "by_step": by_step(curves), "by_seconds": by_seconds(curves)}


def merge_into(result: dict, data: dict, label: str = "", source: str = "") -> None:
    """Add a --seeds result's runs and aggregates (`data`, read from `source`) to `result` (--merge of runs made
    apart: one mode per call, or more seeds of a mode on another day); with `label` each mode is named "<mode>,
    <label>". Seeds of one mode name from several files are pooled and aggregated again, each seed's file, date and
    device kept in `sources` (timings from different machine leases differ by up to ~15%: a spread, not a comparison);
    a seed in two files is one `error:` line."""
    for mode, agg in data["seeds"].items():
        name = f"{mode}, {label}" if label else mode
        runs = _pooled_runs(result, name)
        sources = dict(result.get("seeds", {}).get(name, {}).get("sources", {}))
        for seed in agg["seeds"]:
            if seed in runs:
                before = sources.get(str(seed), {}).get("file") or "?"
                raise SystemExit(f"error: --merge: {mode} seed {seed} is in two files ({before} and {source or '?'}); "
                                 "--labels keeps them apart")
            failed = agg["failed"].get(str(seed), agg["failed"].get(seed))
            runs[seed] = failed if failed is not None else data["modes"][f"{mode}, seed {seed}"]
            sources[str(seed)] = {"file": source, "date": data.get("date"), "device": data.get("device")}
        result.setdefault("seeds", {})[name] = {**aggregate(runs), "sources": sources}
        for seed, run in runs.items():
            if isinstance(run, dict):
                result["modes"][f"{name}, seed {seed}"] = run


def _pooled_runs(result: dict, name: str) -> dict[int, dict | str]:
    """The runs already merged under mode `name`: {seed: curve, or the failure message}."""
    agg = result.get("seeds", {}).get(name)
    if agg is None:
        return {}
    failed = {int(s): msg for s, msg in agg["failed"].items()}
    return {int(s): failed[int(s)] if int(s) in failed else result["modes"][f"{name}, seed {s}"] for s in agg["seeds"]}


def plot(result: dict, png) -> bool:
    """Every seed's curve, the median and the min/max band per mode; False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(f"learn: matplotlib is not installed: no {png.name}")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (mode, agg) in enumerate(result["seeds"].items()):
        colour = f"C{i}"
        for seed in agg["per_seed"]:
            pts = result["modes"][f"{mode}, seed {seed}"]["points"]
            y = [100 * p["exact_match"] for p in pts]
            by_time.plot([p["seconds"] for p in pts], y, "-", color=colour, alpha=0.3, lw=0.8)
            by_step_ax.plot([p["step"] for p in pts], y, "-", color=colour, alpha=0.3, lw=0.8)
        for ax, rows, key in ((by_time, agg["by_seconds"], "seconds"), (by_step_ax, agg["by_step"], "step")):
            x = [r[key] for r in rows]
            ax.fill_between(x, [100 * r["min"] for r in rows], [100 * r["max"] for r in rows], color=colour,
                            alpha=0.15)
            ax.plot(x, [100 * r["median"] for r in rows], "-", color=colour, lw=2,
                    label=f"{mode}: median of {len(agg['per_seed'])} seeds (band: min-max)")
    style_axes(by_time, by_step_ax, "held-out exact match, greedy (%)")
    fig.suptitle(f"GRPO on {result['model_name']}: {result['task']}, seeds ({result['device']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def run_seeds(args, result: dict, run_one: Callable[[str, int], dict]) -> int:
    """Every mode of `args.modes` once per seed of `args.seed_values` (`run_one(mode, seed)`: one run's curve), up
    to `args.concurrent` at once; writes `learn_<task>.json` (each run under "<mode>, seed <S>" in `modes`, each
    mode's `aggregate` in `seeds`) and the PNG. Returns the exit status: 1 when a run failed (its message in
    `seeds.<mode>.failed`)."""
    jobs = [(mode, seed) for mode in args.modes for seed in args.seed_values]
    caps = ("run.max_gpu_memory_gb=", "rollout.gpu_memory_utilization=")
    if args.concurrent > 1 and not any(c.removeprefix("--").startswith(caps) for c in args.cfg):
        print(f"learn: --concurrent {args.concurrent}: on one GPU give each run its share (--cfg "
              "run.max_gpu_memory_gb=GiB), else every run's vLLM takes its default share", flush=True)
    out_json = args.out / f"learn_{args.task}.json"

    def record(done: dict) -> None:  # after each run: a call cut short keeps the runs that finished
        result["modes"] = {f"{mode}, seed {seed}": run for (mode, seed), run in done.items() if isinstance(run, dict)}
        result["seeds"] = {mode: aggregate({s: done[(mode, s)] for s in args.seed_values if (mode, s) in done})
                           for mode in args.modes if any((mode, s) in done for s in args.seed_values)}
        write_text_atomic(out_json, json.dumps(result, indent=1))

    done = run_jobs(jobs, lambda job: run_one(*job), args.concurrent, args.stagger, on_done=record)
    record(done)
    for mode, agg in result["seeds"].items():
        times = {x: t["median_seconds"] for x, t in agg["time_to"].items()}
        ends = {s: v["end"] for s, v in agg["per_seed"].items()}
        print(f"learn: {mode}: median training seconds to {json.dumps(times)}; exact match at the end per seed "
              f"{json.dumps(ends)}", flush=True)
    plot(result, out_json.with_suffix(".png"))
    print(f"learn: wrote {out_json} and {out_json.with_suffix('.png')}")
    return 1 if any(agg["failed"] for agg in result["seeds"].values()) else 0


def style_axes(by_time, by_step, ylabel: str) -> None:
    """The learning plots' two panels: held-out percentages against training seconds and against steps."""
    by_time.set_xlabel("training seconds (evaluation excluded)")
    by_step.set_xlabel("step")
    for ax in (by_time, by_step):
        ax.set_ylabel(ylabel)
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
