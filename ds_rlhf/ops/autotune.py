"""`ds-rlhf autotune`: the fastest settings for a run, measured with short trial runs, within a time budget.

    ds-rlhf autotune --config run.yaml --budget 10m          # -> autotune/overrides.yaml + autotune/trials.json
    ds-rlhf autotune --config run.yaml --budget 30m --steps 4 --out runs/tune --data.train stores/gsm8k
    ds-rlhf autotune --config run.yaml --budget 5m --search data.micro_batch_tokens=8192,16384 \\
        --search rollout.gpu_memory_utilization=              # your own candidates; `KEY=` leaves a knob out
    ds-rlhf train-ppo --config run.yaml --config autotune/overrides.yaml    # then train with the winners

Knobs, searched one at a time in this order, each trial changing one knob of the best point so far:
  rollout.async_generation        off, on (on needs rl.mismatch tis or mis: a combination the config refuses is
                                  recorded as invalid and not run)
  rollout.sidecar_engines         your value, 1, 2, 3 (only with rollout.placement sidecar and the vLLM backend)
  data.micro_batch_tokens         your value and multiples of the longest sequence (prompt + response tokens)
  rollout.gpu_memory_utilization  your value (auto when unset: the run sizes vLLM's KV cache by the work and passes
                                  no value), 0.3, 0.5, 0.7, 0.85 (left out with rollout.backend hf: no effect)
  rollout.max_num_seqs            your value (0 = vLLM's default), 64, 128, 256, 512 (left out with rollout.backend
                                  hf: no effect)
`--search KEY=V1,V2` also adds any other config key as a knob.

Each trial is `python -m ds_rlhf.entrypoints train-ppo` with your config and overrides, the trial's knob values,
`--run.steps N --run.output_dir OUT/trials/NN --run.overwrite true`, and evaluation, sample logs, TensorBoard,
wandb, the HF export and the metrics endpoint off; one process (the trainer's own single-process launch; on a
multi-GPU box it measures one GPU). Its throughput is the median over its steps after the first (warm-up) of
`throughput/completions_per_s` (`--objective tokens`: `throughput/tokens_per_s`) in its metrics.jsonl.

Time: the search never runs past `--budget`. A trial starts only when the time left exceeds 1.25 x the longest
trial so far, and one still running when the budget ends is killed (its whole process group) and recorded as
`timeout`. A trial that fails (non-zero exit, CUDA or vLLM out-of-memory in its log or status.json, no metrics) is
recorded with the reason, and the search goes on. Under `run.max_gpu_memory_gb` the baseline is the split of the
cap the trainer picks (`memory/split.py`), and a trial whose memory plan does not fit the cap is recorded as
`skipped` ("does not fit the cap: ...") without being run. Exit status: 0 when a trial succeeded (overrides.yaml
written), 1 when none did, 2 for bad arguments or a bad config.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds_rlhf.config import Config, ConfigError, parse_config, set_value
from ds_rlhf.entrypoints.train import PPO_DEFAULTS
from ds_rlhf.memory import cap as memory_cap
from ds_rlhf.memory.split import apply_split, choose_split
from ds_rlhf.ops.autotune_trial import OBJECTIVES, Trial, run_trial, trainer_command

KNOB_ORDER = ("rollout.async_generation", "rollout.sidecar_engines", "data.micro_batch_tokens",
              "rollout.gpu_memory_utilization", "rollout.max_num_seqs")
TRIAL_SETTINGS = ["--run.overwrite", "true", "--run.resume", "", "--run.progress", "false", "--run.tensorboard",
                  "false", "--run.wandb", "false", "--run.export_hf", "false", "--run.eval_every", "0",
                  "--run.eval_before_train", "false", "--run.sample_log_every", "0", "--run.metrics_port", "0",
                  "--run.save_every", "0", "--run.keep_last", "1"]
VLLM_ONLY = ("rollout.gpu_memory_utilization", "rollout.max_num_seqs", "rollout.sidecar_engines")  # not with hf
AUTO = "auto"  # a knob's base left to the run (not passed): rollout.gpu_memory_utilization when the user left it unset
KILL_MARGIN_S = 2.0  # the search's own bookkeeping after the last trial
NOT_RUN = ("invalid", "skipped")  # a config the schema refuses; one whose plan does not fit run.max_gpu_memory_gb


@dataclass
class Search:
    budget_s: float
    objective: str
    knobs: dict[str, list]  # knob -> candidates (the base value first)
    skipped: dict[str, str] = field(default_factory=dict)  # knob -> why it is not searched
    trials: list[Trial] = field(default_factory=list)
    elapsed_s: float = 0.0
    stopped: str = ""  # why the search ended before trying every candidate

    def best(self) -> Trial | None:
        ok = [t for t in self.trials if t.status == "ok" and t.objective is not None]
        return max(ok, key=lambda t: t.objective) if ok else None


def parse_budget(text: str) -> float:
    """'10m', '90s', '1.5h' or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--budget {text!r}: expected a positive duration like 90s, 10m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def has_key(key: str) -> bool:
    section, _, name = key.rpartition(".")
    target = getattr(Config(), section, None) if section else Config()
    return target is not None and hasattr(target, name)


def config_value(cfg, key: str):
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def typed(key: str, text: str):
    """A --search value as the config types it (ConfigError for a bad one)."""
    cfg = Config()
    set_value(cfg, key, text)
    return config_value(cfg, key)


def _fmt(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def default_knobs(cfg, custom: dict[str, list[str]]) -> tuple[dict[str, list], dict[str, str]]:
    """(knob -> candidates, knob -> why skipped) for a parsed base config; `custom` are --search lists."""
    seq = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    defaults = {
        "rollout.async_generation": [False, True],
        "data.micro_batch_tokens": [-(-seq * k // 1024) * 1024 for k in (4, 16, 64)],
        "rollout.gpu_memory_utilization": [0.3, 0.5, 0.7, 0.85],
        "rollout.max_num_seqs": [64, 128, 256, 512],
        "rollout.sidecar_engines": [1, 2, 3],
    }
    knobs, skipped = {}, {}
    for key in [*KNOB_ORDER, *(k for k in custom if k not in KNOB_ORDER)]:
        if not has_key(key):
            skipped[key] = "not a config key in this version of ds_rlhf"
            continue
        if key in custom and not custom[key]:
            skipped[key] = "left out (--search KEY=)"
            continue
        if key in VLLM_ONLY and cfg.rollout.backend == "hf" and key not in custom:
            skipped[key] = "no effect with rollout.backend hf"
            continue
        if key == "rollout.sidecar_engines" and cfg.rollout.placement != "sidecar" and key not in custom:
            skipped[key] = f"needs rollout.placement sidecar (this run: {cfg.rollout.placement})"
            continue
        base = config_value(cfg, key)
        if key == "rollout.gpu_memory_utilization" and key not in cfg.given and cfg.run.max_gpu_memory_gb <= 0:
            base = AUTO  # the run's own sizing by the work (memory/engine_budget.py), tried as it is
        values = [typed(key, v) for v in custom[key]] if key in custom else defaults.get(key, [])
        knobs[key] = [base, *[v for v in dict.fromkeys(values) if _fmt(v) != _fmt(base)]]
    return knobs, skipped


def parse_search(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--search {item!r}: expected KEY=V1,V2,... (or KEY= to leave a knob out)")
        out[key.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    return out


# ---- the search ----------------------------------------------------------------------------------------------
def _knob_args(knobs: dict) -> list[str]:
    return [a for key, value in knobs.items() if value != AUTO for a in (f"--{key}", _fmt(value))]


def _check(base_argv: list[str], knobs: dict) -> tuple[str, str]:
    """("", "") when the trial's config parses and, under `run.max_gpu_memory_gb`, its plan fits the cap (with the
    split the trainer would pick for what is left unset); else ("invalid" | "skipped", the one-line reason)."""
    try:
        cfg = parse_config(base_argv + _knob_args(knobs), PPO_DEFAULTS)
    except ConfigError as exc:
        return "invalid", str(exc)
    if cfg.run.max_gpu_memory_gb <= 0:
        return "", ""
    try:
        total = memory_cap.local_gpu_total() or memory_cap.cap_bytes(cfg)
        split = choose_split(cfg, total)
        if split is not None:
            apply_split(cfg, split)
        memory_cap.check_memory_cap(cfg, kind="rl", total_bytes=total, world_size=1)
    except ConfigError as exc:
        return "skipped", f"does not fit the cap: {exc}"
    except (OSError, ValueError) as exc:  # no config.json to plan from: the trial itself says what is wrong
        return "", f"{type(exc).__name__}: {exc}"
    return "", ""


def run_search(base_argv: list[str], knobs: dict[str, list], out: Path, *, budget_s: float, steps: int = 4,
               objective: str = "completions", max_trials: int = 0, skipped: dict | None = None,
               command=trainer_command, keep_checkpoints: bool = False, log=print) -> Search:
    """Coordinate search over `knobs` (the first candidate of each is the base value); see the module docstring."""
    deadline = time.monotonic() + budget_s
    started = time.monotonic()
    search = Search(budget_s, objective, knobs, dict(skipped or {}))
    point = {k: v[0] for k, v in knobs.items()}
    plan = [("", None)] + [(k, v) for k, values in knobs.items() for v in values[1:]]
    (out / "trials").mkdir(parents=True, exist_ok=True)
    current_knob = None
    for changed, value in plan:
        if changed != current_knob:  # a new knob: continue from the best point so far
            best = search.best()
            point = dict(best.knobs) if best else point
            current_knob = changed
        knobs_now = {**point, **({changed: value} if changed else {})}
        trial = Trial(len(search.trials), knobs_now, changed)
        left = deadline - time.monotonic() - KILL_MARGIN_S
        longest = max((t.seconds for t in search.trials if t.status not in NOT_RUN), default=0.0)
        if max_trials and len([t for t in search.trials if t.status not in NOT_RUN]) >= max_trials:
            search.stopped = f"--max-trials {max_trials} reached"
            break
        if left <= 1.0 or (longest and left < 1.25 * longest):
            search.stopped = (f"budget: {max(left, 0):.0f}s left, less than 1.25 x the longest trial "
                              f"({longest:.0f}s)")
            break
        status, error = _check(base_argv, knobs_now)
        if status:
            trial.status, trial.error = status, error
        else:
            run_dir = out / "trials" / f"{trial.index:02d}"
            argv = [*base_argv, *_knob_args(knobs_now), "--run.steps", str(steps), "--run.output_dir",
                    str(run_dir), *TRIAL_SETTINGS]
            log(f"[autotune] trial {trial.index}: {_describe(trial)} ({left:.0f}s of the budget left)")
            run_trial(trial, argv, run_dir, out / "trials" / f"{trial.index:02d}.log", timeout=left,
                      objective=objective, command=command, keep_checkpoints=keep_checkpoints)
        search.trials.append(trial)
        log(f"[autotune] trial {trial.index}: {trial.status}" + (f", {objective}/s {trial.objective:.4g}"
                                                                if trial.objective is not None else "")
            + (f" ({trial.error})" if trial.error else "") + f" in {trial.seconds:.1f}s")
        write_results(search, out)
    search.elapsed_s = round(time.monotonic() - started, 1)
    write_results(search, out)
    return search


def _describe(trial: Trial) -> str:
    return "baseline" if not trial.changed else f"{trial.changed}={_fmt(trial.knobs[trial.changed])}"


# ---- output --------------------------------------------------------------------------------------------------
def overrides_mapping(knobs: dict) -> dict:
    """Dotted keys -> a mapping nested by section, as `--config` reads it."""
    out: dict = {}
    for key, value in knobs.items():
        if value == AUTO:
            continue
        section, _, name = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


def write_results(search: Search, out: Path) -> None:
    import yaml

    table = {"budget_s": search.budget_s, "elapsed_s": search.elapsed_s, "objective": search.objective,
             "knobs": search.knobs, "skipped_knobs": search.skipped, "stopped": search.stopped,
             "trials": [asdict(t) for t in search.trials]}
    best = search.best()
    table["best"] = asdict(best) if best else None
    (out / "trials.json").write_text(json.dumps(table, indent=1, default=str) + "\n")
    if best is not None:
        text = yaml.safe_dump(overrides_mapping(best.knobs), sort_keys=True)
        header = (f"# ds-rlhf autotune: the fastest of {len(search.trials)} trials (trial {best.index}, "
                  f"{best.objective:.4g} {search.objective}/s)\n# use: ds-rlhf train-ppo --config <your config> "
                  f"--config {out / 'overrides.yaml'} [the same --key value overrides]\n")
        (out / "overrides.yaml").write_text(header + text)


def format_table(search: Search) -> str:
    rows = [("#", "status", "seconds", f"{search.objective}/s", "changed", "note")]
    for t in search.trials:
        rows.append((str(t.index), t.status, f"{t.seconds:.1f}", "" if t.objective is None else f"{t.objective:.4g}",
                     _describe(t), t.error[:80]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for key, why in search.skipped.items():
        lines.append(f"not searched: {key} ({why})")
    if search.stopped:
        lines.append(f"stopped early: {search.stopped}")
    best = search.best()
    lines.append(f"best: trial {best.index} ({_describe(best)}): " + ", ".join(f"{k}={_fmt(v)}"
                                                                                 for k, v in best.knobs.items())
                 if best else "no trial succeeded")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-rlhf autotune", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1] + "\nAny other --section.key value is passed "
                                "to every trial (as train-ppo takes it).")
    p.add_argument("--config", help="the run's config (YAML/JSON, as train-ppo takes it)")
    p.add_argument("--budget", default="10m", help="wall time for the whole search: 90s, 10m, 1h (default 10m)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per trial (default 4); the first is warm-up and "
                   "left out, so more steps give a steadier median")
    p.add_argument("--objective", choices=sorted(OBJECTIVES), default="completions",
                   help="what to maximise: completions/s (default) or tokens/s")
    p.add_argument("--search", action="append", default=[], metavar="KEY=V1,V2",
                   help="candidates for a knob (repeatable); KEY= leaves it out")
    p.add_argument("--max-trials", type=int, default=0, help="stop after this many trials (0 = only the budget)")
    p.add_argument("--out", default="autotune", help="where trials, trials.json and overrides.yaml go")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each trial's checkpoints (default: delete)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)

    base_argv = (["--config", args.config] if args.config else []) + rest
    try:
        budget = parse_budget(args.budget)
        if args.steps < 1:
            raise ValueError("--steps must be >= 1")
        cfg = parse_config(base_argv, PPO_DEFAULTS)
        if cfg.run.max_gpu_memory_gb > 0:  # the search starts from the split the trainer would pick for the cap
            split = choose_split(cfg, memory_cap.local_gpu_total() or memory_cap.cap_bytes(cfg))
            if split is not None:
                apply_split(cfg, split)
                print(f"[autotune] the baseline: {split.line(cfg.run.max_gpu_memory_gb)}")
        knobs, skipped = default_knobs(cfg, parse_search(args.search))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"ds-rlhf autotune: {exc}", file=sys.stderr)
        return 2
    for key, why in skipped.items():
        print(f"[autotune] not searching {key}: {why}")
    out = Path(args.out)
    search = run_search(base_argv, knobs, out, budget_s=budget, steps=args.steps, objective=args.objective,
                        max_trials=args.max_trials, skipped=skipped, keep_checkpoints=args.keep_checkpoints)
    print(format_table(search))
    print(f"[autotune] {len(search.trials)} trials in {search.elapsed_s:.0f}s of {budget:.0f}s: {out / 'trials.json'}"
          + (f", {out / 'overrides.yaml'}" if search.best() else ""))
    return 0 if search.best() else 1


if __name__ == "__main__":
    sys.exit(main())
