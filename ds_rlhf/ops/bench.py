"""`ds-rlhf bench <name> [args...]`: run one of the checkout's benchmarks, then print a table of its JSON.

    ds-rlhf bench rollout [--shapes 0.5b] [--tiny]     bench/rollout_gpu.py: weight sync, generate tokens/s vs plain
                                                       vLLM, vLLM sleep / wake
    ds-rlhf bench sync [--bucket-mb 1024 256]          bench/rollout_gpu.py too: it has no sync-only mode, so this runs
                                                       the same benchmark and tabulates its weight-sync rows (GB,
                                                       seconds, GB/s per bucket size, canary)
    ds-rlhf bench rl-step [--async] [--tiny]           bench/rl_step_gpu.py: a GRPO/PPO run through the trainer,
                                                       per-phase medians, completions/s, MFU
    ds-rlhf bench engines [--configs zero2,zero3]      bench/engines_gpu.py: DeepSpeed ZeRO-2 / ZeRO-3 / offload
                                                       training steps, tokens/s, TFLOP/s, peak memory
    ds-rlhf bench data [--size_gib 2]                  bench/data_loading.py: io_uring / mmap / datasets reads, GB/s
    ds-rlhf bench learn --model M [--task gsm8k]       bench/learn.py: GRPO on a real model, held-out exact match
                                                       against seconds and steps, synchronous and async
    ds-rlhf bench <name> --help                        that script's own options, forwarded

bench/ is not a package: its scripts live in the checkout beside ds_rlhf/, found from where ds_rlhf is imported
(the editable install points there), and each runs as `python bench/<script>.py ARGS` in a child process with
this Python. Without a checkout (a non-editable install) there is nothing to run, and the command says so.

Every run writes JSON: `--json-out PATH` (this command's own option; default ./bench_<name>.json, for rl-step and
learn the directory ./bench_rl_step / ./bench_learn) is passed as the script's own output option unless you pass
that option yourself: rollout/sync --out FILE; rl-step --out DIR, which gets rl_step_<tag>.json and a PNG timeline;
learn --out DIR, which gets learn_<task>.json and its PNG; engines/data --json FILE. The exit status is the
script's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ds_rlhf

REPO_ROOT = Path(ds_rlhf.__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "bench"


@dataclass(frozen=True)
class Bench:
    script: str
    out_option: str  # the script's own JSON option
    out_is_dir: bool
    about: str
    result_glob: str = ""  # with out_is_dir: the JSON the script writes into that directory


BENCHES = {
    "rollout": Bench("rollout_gpu.py", "--out", False, "weight sync + generate tokens/s + sleep/wake (one GPU)"),
    "sync": Bench("rollout_gpu.py", "--out", False, "the weight-sync rows of rollout_gpu.py (no sync-only mode)"),
    "rl-step": Bench("rl_step_gpu.py", "--out", True, "a GRPO/PPO run: per-phase medians, completions/s, MFU",
                     "rl_step_*.json"),
    "learn": Bench("learn.py", "--out", True, "GRPO on a real model: held-out exact match vs seconds, sync + async",
                   "learn_*.json"),
    "engines": Bench("engines_gpu.py", "--json", False, "ZeRO-2/3/offload training steps: tokens/s, memory"),
    "data": Bench("data_loading.py", "--json", False, "io_uring / mmap / datasets store reads: GB/s, samples/s"),
}


# ---- tables ------------------------------------------------------------------------------------------------------
def text_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cell = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cell)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cell]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def rollout_rows(data: dict) -> list[dict]:
    rows = []
    for shape, r in data.get("results", {}).items():
        if "error" in r:
            rows.append({"shape": shape, "error": r["error"]})
            continue
        sync = next(iter(r.get("sync", {}).values()), {})
        gen = r.get("generate", {}).get("tokens_per_s_best", {})
        sleep = r.get("sleep", {}).get("level1", {})
        rows.append({"shape": shape, "sync GB/s": sync.get("gbps_median"), "ours tok/s": gen.get("ours"),
                     "plain+logprobs tok/s": gen.get("plain_logprobs"), "plain tok/s": gen.get("plain_no_logprobs"),
                     "ours/plain+lp": r.get("generate", {}).get("ratio_ours_vs_plain_logprobs"),
                     "sleep L1 freed GB": sleep.get("freed_gb"), "sleep L1 s": sleep.get("seconds")})
    return rows


def sync_rows(data: dict) -> list[dict]:
    rows = []
    for shape, r in data.get("results", {}).items():
        if "error" in r:
            rows.append({"shape": shape, "error": r["error"]})
        for bucket, s in r.get("sync", {}).items():
            rows.append({"shape": shape, "bucket": bucket.removeprefix("bucket_"), "GB": s["bytes"] / 1e9,
                         "buckets": s.get("buckets"), "seconds": s.get("seconds_median"), "GB/s": s.get("gbps_median"),
                         "canary after": s.get("canary_after_sync")})
    return rows


def rl_step_rows(data: dict) -> list[dict]:
    rows = [{"metric": k, "value": data.get(k)} for k in ("tag", "steps", "steady_steps", "completions_per_s",
                                                           "setup_seconds", "total_seconds") if k in data]
    rows += [{"metric": f"median {k}", "value": v} for k, v in sorted(data.get("median", {}).items())
             if k.startswith(("time/", "throughput/"))]
    mfu = data.get("mfu") or {}
    rows += [{"metric": f"mfu/{k}", "value": mfu[k]} for k in ("train_tflops", "mfu") if mfu.get(k) is not None]
    gpu = data.get("gpu") or {}
    rows += [{"metric": f"gpu/{k}", "value": v} for k, v in gpu.items() if isinstance(v, int | float)]
    return rows


def learn_rows(data: dict) -> list[dict]:
    return [{"task": data.get("task"), "mode": mode, **run.get("summary", {})}
            for mode, run in data.get("modes", {}).items()]


def engines_rows(data: list) -> list[dict]:
    return [{"config": r.get("config"), "error": r["error"]} if "error" in r else
            {"config": r["config"], "tokens/s": r.get("tokens_per_s"), "TFLOP/s (6N)": r.get("tflops"),
             "step s": r.get("step_s"), "peak GiB": r.get("peak_mem_bytes", 0) / 2**30,
             "peak kind": r.get("peak_mem_kind"), "device": r.get("device")} for r in data]


def data_rows(data: dict) -> list[dict]:
    return [{"method": r["method"], "temp": r["temp"], "GB/s median": r["gbps_median"],
             "GB/s min-max": f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f}", "samples/s": r["samples_s_median"],
             "reader": r.get("reader")} for r in data.get("summary", [])]


TABLES = {"rollout": rollout_rows, "sync": sync_rows, "rl-step": rl_step_rows, "learn": learn_rows,
          "engines": engines_rows, "data": data_rows}


def table_of(name: str, data) -> str:
    try:
        return text_table(TABLES[name](data))
    except (KeyError, TypeError, AttributeError, StopIteration) as exc:  # an older script's JSON: say so, no crash
        return f"(no table: the JSON has another shape than expected: {type(exc).__name__}: {exc})"


# ---- running -----------------------------------------------------------------------------------------------------
def usage() -> str:
    rows = "\n".join(f"  {name:<9}bench/{b.script:<17}{b.about}" for name, b in BENCHES.items())
    return f"usage: ds-rlhf bench <name> [--json-out PATH] [script args...]\n\nbenchmarks:\n{rows}\n\n{__doc__}"


def _given(args: list[str], option: str) -> str | None:
    for i, a in enumerate(args):
        if a == option and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(option + "="):
            return a.split("=", 1)[1]
    return None


def _pop_json_out(args: list[str]) -> tuple[str | None, list[str]]:
    value = _given(args, "--json-out")
    rest, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--json-out":
            skip = True
            continue
        if a.startswith("--json-out="):
            continue
        rest.append(a)
    return value, rest


def _result_file(bench: Bench, target: Path, started: float) -> Path | None:
    if not bench.out_is_dir:
        return target if target.is_file() else None
    found = [p for p in target.glob(bench.result_glob) if p.stat().st_mtime >= started - 1]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def run_bench(name: str, args: list[str], python: str = sys.executable) -> int:
    bench = BENCHES[name]
    script = BENCH_DIR / bench.script
    if not script.is_file():
        print(f"ds-rlhf bench: {script} not found: the bench/ scripts come with a checkout of ds_rlhf (an editable "
              f"install), not with the installed package ({REPO_ROOT})", file=sys.stderr)
        return 2
    if "-h" in args or "--help" in args:
        return subprocess.run([python, str(script), *args]).returncode
    json_out, args = _pop_json_out(args)
    given = _given(args, bench.out_option)
    target = Path(given or json_out or (f"bench_{name.replace('-', '_')}" + ("" if bench.out_is_dir else ".json")))
    if given is None:
        args = [*args, bench.out_option, str(target)]
    if not bench.out_is_dir:
        target.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    code = subprocess.run([python, str(script), *args]).returncode
    result = _result_file(bench, target, started)
    if result is None:
        print(f"ds-rlhf bench {name}: no JSON written (exit {code})", file=sys.stderr)
        return code or 1
    print(f"\nds-rlhf bench {name}: {result}\n{table_of(name, json.loads(result.read_text()))}")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"ds-rlhf bench: unknown benchmark {name!r}; choose one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return run_bench(name, rest)


if __name__ == "__main__":
    sys.exit(main())
