"""The run report's plots: PNGs drawn with matplotlib's Agg backend (no display) from `metrics.jsonl` records.

A plot is drawn only when at least one of its metrics is in the records; values logged as strings ("nan", "inf":
the logger writes non-finite floats that way) become gaps. A plot's keys may be patterns (`eval/pass@*`, matched
with `fnmatch`). Which plots a run gets follows from what it logged:

    RL    reward, held-out evaluation (eval/pass@k, eval/mean@k, eval/reward_mean), KL, entropy, response length
    SFT   loss (train/loss, eval/loss), perplexity
    RM    loss, accuracy (train/ and eval/), margin (chosen - rejected score)
    DPO   loss (dpo/loss, eval/loss), accuracy and margin of the implicit rewards, the chosen and rejected rewards
    all   throughput, time per phase, GPU (or process) memory

A `final/` key (SFT, RM and DPO log their last evaluation under it) is drawn as one more point of its curve.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

PHASE_SKIP = ("time/step", "time/wall")  # totals, not phases
GPU_MEMORY_KEYS = ("sys/gpu_mem_used_gb", "sys/gpu_mem_peak_gb", "sys/gpu_mem_allocated_gb")


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file stem
    title: str
    keys: tuple[str, ...]
    ylabel: str
    band: tuple[str, str] | None = None  # (mean key, std key): shade mean +- std
    right: tuple[str, ...] = ()  # keys on a second y axis (another scale)


LINE_PLOTS = (
    PlotSpec("reward", "Reward", ("reward/mean", "reward/exact_match"), "reward", band=("reward/mean", "reward/std")),
    PlotSpec("eval", "Held-out evaluation", ("eval/pass@*", "eval/mean@*", "eval/reward_mean"), "score"),
    PlotSpec("loss", "Loss", ("train/loss", "dpo/loss", "eval/loss", "final/eval/loss"), "loss"),
    PlotSpec("perplexity", "Eval perplexity", ("eval/perplexity", "final/eval/perplexity"), "perplexity"),
    PlotSpec("accuracy", "Accuracy (chosen scored above rejected)",
             ("train/accuracy", "eval/accuracy", "final/eval/accuracy", "rewards/accuracy", "eval/rewards/accuracy",
              "final/eval/rewards/accuracy"), "fraction of pairs"),
    PlotSpec("margin", "Margin (chosen - rejected)",
             ("train/margin", "rewards/margin", "eval/rewards/margin", "final/eval/rewards/margin"), "margin"),
    PlotSpec("dpo_rewards", "DPO implicit rewards", ("rewards/chosen", "rewards/rejected", "eval/rewards/chosen",
                                                     "eval/rewards/rejected"), "beta * log-ratio"),
    PlotSpec("kl", "KL", ("kl/mean", "mismatch/kl_rollout_trainer", "actor/approx_kl"), "nats", right=("kl/coef",)),
    PlotSpec("entropy", "Policy entropy", ("actor/entropy",), "nats per token"),
    PlotSpec("response_length", "Response length", ("response/len_mean", "response/len_max",
                                                    "eval/response_len_mean"), "tokens"),
    PlotSpec("throughput", "Throughput", ("throughput/tokens_per_s",), "tokens / s"),
)


def value(record: dict, key: str) -> float | None:
    """A record's metric as a float (NaN for 'nan'/'inf' strings and junk), None when absent."""
    if key not in record:
        return None
    raw = record[key]
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that have `key` (a record without `step` uses its position)."""
    xs, ys = [], []
    for i, r in enumerate(records):
        v = value(r, key)
        if v is not None:
            xs.append(_step(r, i))
            ys.append(v)
    return xs, ys


def _step(record: dict, index: int) -> float:
    step = value(record, "step")
    return step if step is not None and not math.isnan(step) else float(index + 1)


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def present_keys(records: list[dict], patterns: tuple[str, ...]) -> list[str]:
    """The keys of the records that match `patterns` (names or `fnmatch` patterns), in the patterns' order."""
    logged = list(dict.fromkeys(k for r in records for k in r))
    out: list[str] = []
    for pattern in patterns:
        out += sorted(k for k in logged if fnmatch.fnmatchcase(k, pattern) and k not in out)
    return out


def line_plot(records: list[dict], spec: PlotSpec, out_dir: Path) -> Path | None:
    present = present_keys(records, spec.keys)
    if not present:
        return None
    fig, ax = _figure(spec.title, spec.ylabel)
    for key in present:
        xs, ys = series(records, key)
        marker = {"marker": "o", "markersize": 3} if len(xs) < 30 else {}  # sparse curves (evaluations) stay visible
        ax.plot(xs, ys, label=key, **marker)
    if spec.band and any(spec.band[1] in r for r in records):
        xs, mean = series(records, spec.band[0])
        std = [value(r, spec.band[1]) for r in records if spec.band[0] in r]
        std = [s if s is not None and not math.isnan(s) else 0.0 for s in std]
        ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.15,
                        label=f"+- {spec.band[1]}")
    handles, labels = ax.get_legend_handles_labels()
    right = [k for k in spec.right if any(k in r for r in records)]
    if right:
        twin = ax.twinx()
        for key in right:
            twin.plot(*series(records, key), label=key, color="gray", linestyle="--")
        twin.set_ylabel(", ".join(right))
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8)
    return _save(fig, out_dir / f"{spec.name}.png")


def phase_keys(records: list[dict]) -> list[str]:
    keys = {k for r in records for k in r if k.startswith("time/") and k not in PHASE_SKIP}
    return sorted(keys)


def phase_plot(records: list[dict], out_dir: Path) -> Path | None:
    """Seconds per phase, stacked, with the step's wall time on top (the gap is time outside every phase)."""
    keys = phase_keys(records)
    if not keys:
        return None
    fig, ax = _figure("Time per phase (stacked)", "seconds")
    xs = [_step(r, i) for i, r in enumerate(records)]
    stacks = [[(v if (v := value(r, k)) is not None and not math.isnan(v) else 0.0) for r in records] for k in keys]
    ax.stackplot(xs, stacks, labels=[k.removeprefix("time/") for k in keys], alpha=0.85)
    if any("time/wall" in r for r in records):
        ax.plot(*series(records, "time/wall"), color="black", linewidth=1.2, label="wall")
    if len(set(xs)) == 1:
        ax.set_xlim(xs[0] - 0.5, xs[0] + 0.5)
    ax.legend(fontsize=8, loc="upper left", ncol=4)
    return _save(fig, out_dir / "phases.png")


def gpu_plot(records: list[dict], out_dir: Path) -> Path | None:
    """GPU utilisation (left axis) and memory (right axis); `gpu/*` keys too. CPU runs: the process's peak RSS."""
    util_keys = [k for k in ("sys/gpu_util_pct", "gpu/util", "gpu/util_pct") if any(k in r for r in records)]
    mem_keys = [k for k in GPU_MEMORY_KEYS if any(k in r for r in records)]
    mem_keys += sorted({k for r in records for k in r if k.startswith("gpu/") and k not in util_keys})
    title = "GPU utilisation and memory"
    if not util_keys and not mem_keys:
        mem_keys = ["sys/cpu_max_rss_gb"] if any("sys/cpu_max_rss_gb" in r for r in records) else []
        title = "Process memory (peak RSS)"
    if not util_keys and not mem_keys:
        return None
    fig, ax = _figure(title, "utilisation %" if util_keys else "GiB")
    for key in util_keys:
        ax.plot(*series(records, key), label=key, color="black")
    mem_ax = ax.twinx() if util_keys and mem_keys else ax
    if mem_ax is not ax:
        mem_ax.set_ylabel("GiB")
        ax.set_ylim(0, 105)
    for key in mem_keys:
        mem_ax.plot(*series(records, key), label=key, linestyle="--" if mem_ax is not ax else "-")
    handles = ax.get_legend_handles_labels()
    if mem_ax is not ax:
        more = mem_ax.get_legend_handles_labels()
        handles = (handles[0] + more[0], handles[1] + more[1])
    ax.legend(*handles, fontsize=8, loc="lower right")
    return _save(fig, out_dir / "gpu.png")


def render_plots(records: list[dict], out_dir: str | Path) -> list[tuple[str, Path]]:
    """Every plot the records allow, as (title, PNG path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for spec in LINE_PLOTS:
        if (path := line_plot(records, spec, out_dir)) is not None:
            made.append((spec.title, path))
    for title, draw in (("Time per phase", phase_plot), ("GPU / memory", gpu_plot)):
        if (path := draw(records, out_dir)) is not None:
            made.append((title, path))
    return made
