"""The learning benchmark's results (`bench/learn.py`): a run's curve (held-out exact match against steps, training
seconds and generated tokens; per-step lengths and a summary), the GPU's use over the training steps, the PNG, and
`--merge` of several runs' JSON files.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import learn_seeds
from gpu_timeline import summarize as summarize_gpu

EXACT = "eval/pass@1"
FORMAT = "eval/reward/eval_reward/format"
LENIENT = "eval/reward/eval_reward/lenient"


def _episode(h: dict, prefix: str) -> dict:
    """The episode figures of a metrics record (`episode/...`, `eval/episode/...`); empty for single turns."""
    if f"{prefix}episode/tool_call_rate" not in h:
        return {}
    return {"tool_call_rate": h[f"{prefix}episode/tool_call_rate"], "turns_mean": h.get(f"{prefix}episode/turns_mean")}


def curve(history: list[dict]) -> dict:
    """The evaluation points against steps, training seconds and generated tokens, and per-step lengths."""
    seconds = tokens = 0.0
    points, lengths = [], []
    for h in history:
        if h.get("step", 0) > 0:
            seconds += h.get("time/wall", 0.0)
            tokens += h.get("response/len_mean", 0.0) * h.get("rollout/samples", 0.0)
            lengths.append({k: h.get(f"response/{k}") for k in ("len_mean", "len_p50", "len_max", "truncated_frac")}
                           | {"step": h["step"], "rollout_seconds": h.get("time/rollout"),
                              "tail_decode_frac": h.get("rollout/tail_decode_frac"),
                              "staleness_mean": h.get("rollout/staleness_mean", h.get("rollout/staleness")),
                              "staleness_max": h.get("rollout/staleness_max", h.get("rollout/staleness"))}
                           | _episode(h, ""))
        if EXACT in h:
            points.append({"step": h.get("step", 0), "seconds": round(seconds, 2), "generated_tokens": int(tokens),
                           "exact_match": h[EXACT], "exact_match_lenient": h.get(LENIENT),
                           "format": h.get(FORMAT),
                           "response_len_mean": h.get("eval/response_len_mean"),
                           "truncated_frac": h.get("eval/truncated_frac")} | _episode(h, "eval/"))
    steps = [h for h in history if h.get("step", 0) > 0]
    summary = {"steps": len(steps), "train_seconds": round(seconds, 1), "generated_tokens": int(tokens)}
    if steps:
        summary["step_seconds_median"] = statistics.median(h["time/wall"] for h in steps)
        summary["completions_per_s_median"] = statistics.median(h["throughput/completions_per_s"] for h in steps)
        for key, name in (("time/rollout", "rollout_seconds_median"), ("time/train", "train_seconds_median"),
                          ("rollout/tail_decode_frac", "tail_decode_frac_median")):
            if all(key in h for h in steps):
                summary[name] = statistics.median(h[key] for h in steps)
        ages = [(x["staleness_mean"], x["staleness_max"]) for x in lengths if x["staleness_max"] is not None]
        if ages:  # updates between a trained sample's weights and the trainer's (rollout.max_staleness bounds it)
            summary["staleness_mean"] = statistics.fmean(mean for mean, _ in ages)
            summary["staleness_max"] = max(top for _, top in ages)
    if points:
        summary |= {"exact_match_start": points[0]["exact_match"], "exact_match_end": points[-1]["exact_match"],
                    "exact_match_best": max(p["exact_match"] for p in points)}
    return {"points": points, "lengths": lengths, "summary": summary}


def plot(result: dict, png: Path) -> None:
    """The PNG; where matplotlib is missing (a bare GPU image) say so: `--merge` draws it later from the JSON."""
    try:
        import matplotlib
    except ImportError:
        print(f"learn: matplotlib is not installed: no {png.name} (run --merge on the JSON where it is)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, run in result["modes"].items():
        pts = run["points"]
        exact, fmt = [100 * p["exact_match"] for p in pts], [100 * (p["format"] or 0) for p in pts]
        tools = [100 * p["tool_call_rate"] for p in pts if "tool_call_rate" in p]
        for ax, x in ((by_time, [p["seconds"] for p in pts]), (by_step, [p["step"] for p in pts])):
            line, = ax.plot(x, exact, "o-", label=f"{mode}: exact match")
            if any(p["format"] is not None for p in pts):
                ax.plot(x, fmt, "--", color=line.get_color(), alpha=0.6, label=f"{mode}: format")
            if len(tools) == len(pts):  # episodes: the share of turns that called a tool
                ax.plot(x, tools, ":", color=line.get_color(), label=f"{mode}: tool-call rate")
    learn_seeds.style_axes(by_time, by_step, "held-out, greedy (%)")
    settings = result["settings"]
    reward = (f"{Path(settings['environment'].rpartition(':')[0]).stem} episodes" if settings.get("environment")
              else f"{settings.get('reward', 'strict')} reward")
    warm = f", after {result['warm_start']['steps']} SFT steps" if result.get("warm_start") else ""
    fig.suptitle(f"GRPO on {result['model_name']}{warm}: {result['task']}, {reward} ({result['device']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def merge(files: list[Path], out: Path, labels: list[str] | None = None) -> Path:
    """One JSON and PNG of several runs' modes; with `labels` (one per file) each mode is named "<mode>, <label>",
    so runs of the same mode with different settings stay apart."""
    result = None
    for i, f in enumerate(files):
        data = json.loads(f.read_text())
        result = result or {**{k: v for k, v in data.items() if k != "seeds"}, "modes": {}}
        if data.get("seeds"):  # a --seeds run: its runs and each mode's aggregate
            learn_seeds.merge_into(result, data, labels[i] if labels else "", str(f))
        else:
            result["modes"].update({f"{mode}, {labels[i]}" if labels else mode: run
                                    for mode, run in data["modes"].items()})
        if data.get("warm_start", {}).get("step0") and result.get("warm_start"):  # each run's own warm start
            result["warm_start"] = {**result["warm_start"], "step0": {**result["warm_start"].get("step0", {}),
                                                                      **data["warm_start"]["step0"]}}
    out_json = out / f"learn_{result['task']}.json"
    out_json.write_text(json.dumps(result, indent=1))
    (learn_seeds.plot if result.get("seeds") else plot)(result, out_json.with_suffix(".png"))
    return out_json


def gpu_use(samples: list, source: str | None, metrics: list[dict]) -> dict:
    """The GPU's utilisation (mean %) and used memory (max GiB, whole device) from the NVML samples (time, %, GiB)
    taken while the trainer ran, over its training steps: from the end of step 1 to the end of the last step
    (the metrics' `time`; evaluations inside that window included). Empty without a GPU."""
    ends = [m["time"] for m in metrics if m.get("step", 0) >= 1 and "time" in m]
    window = (min(ends), max(ends)) if ends else (0.0, 0.0)
    out = summarize_gpu(samples, [], window)
    return {"source": source, "window": list(window), "gpu_util_mean": out["gpu_util_mean"],
            "gpu_mem_max_gib": out["gpu_mem_max_gib"], "samples": out["samples"]}
