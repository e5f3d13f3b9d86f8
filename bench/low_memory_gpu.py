"""Low-memory benchmark: SFT, RM, PPO and GRPO steps of an 8B Llama-3 shape under a GPU memory cap.

Each phase runs as its own child process through the real CLI (`python -m ds_rlhf.entrypoints train-sft |
train-rm | train-ppo`) with `--config ds_configs/low_memory_24g.yaml` (LoRA, shared base, ZeRO-3 + offload,
gradient checkpointing, vLLM level-2 sleep, `run.max_gpu_memory_gb`) plus overrides: the model, small random data
stores, `run.steps`, the cap, the run directory. While a phase runs, a sampler (`bench/gpu_timeline.py`: pynvml,
else `nvidia-smi -lms`) records the device memory used. Per phase it records: the exit code, the wall time, the
per-step time (`time/wall` and the other `time/*` keys of the run's metrics.jsonl), the NVML peak (GiB; the idle
reading before the phase too), torch's allocator peak (`sys/gpu_mem_peak_gb`) and, for RL, the per-phase peaks of
`--run.profile_memory` against the plan (`memory/*`), the host RSS peak (`sys/cpu_max_rss_gb`), whether the NVML peak
is <= the cap, the planned breakdown (`ds-rlhf memory --json` with the same arguments), the command line and the
run's resolved config. A phase that fails (OOM, the cap preflight refusing, a timeout) keeps its last log lines
and a one-word reason, and the next phase runs.

The model is a random-init Llama-3 8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256)
built once on the GPU (meta device, `to_empty`, normal init, bf16) and saved as safetensors in --workdir (reused
when there). Its tokenizer is the offline tiny one (ids < 512; the model's vocabulary stays 128256, so the head
costs what it costs on the real model). Data: random token rows of --seq-len (SFT / preference pairs) and prompts
of --prompt-len (`bench_inputs.build_prompts`). Rewards: `bench/bench_rewards.py:distinct_ratio` by default (cheap,
varies between samples), any `reward.fn`, or `--reward rm` (the rm phase's export as `reward.model`).

Results accumulate in WORKDIR/low_memory.json across invocations (one device command is limited to 10 minutes, so
run the phases in separate commands on the same machine); each invocation writes the merged file to
OUT/low_memory.json and prints a markdown table of every phase recorded so far (for docs/PERFORMANCE.md). Each
phase's log is written to OUT/logs/ as it runs (and copied to WORKDIR/runs/ when it ends), and low_memory.json names
the phase in progress (keeping that phase's previous record under "previous"), so a device command stopped mid-phase
still brings back what that phase printed.

On the GPU machine (DeepSpeed and vLLM on PYTHONPATH as the device recipe puts them):

    python3 bench/low_memory_gpu.py --shape 8b --phases sft --steps 3 --out $OUT        # builds /tmp/ds_rlhf_lowmem
    python3 bench/low_memory_gpu.py --shape 8b --phases rm,grpo --steps 3 --out $OUT
    python3 bench/low_memory_gpu.py --shape 8b --phases ppo --steps 3 --out $OUT
    python3 bench/low_memory_gpu.py --shape 8b --phases grpo --extra "--model.quantize_base nf4" --tag nf4 --out $OUT
    python3 bench/low_memory_gpu.py --full-ft-sweep --out $OUT       # largest full-FT model: 3b, 8b, 13b, 20b
    python3 bench/low_memory_gpu.py --shape tiny --phases sft,rm,grpo --steps 2 --out /tmp/lm   # CPU logic check

`--full-ft-sweep` (secondary): for each Llama shape, SFT with full fine-tuning (no LoRA, no cap) at ZeRO-3 with and
without CPU optimizer/weight offload, 2 steps each; the planner screens each try first (device and host memory) and
skips the ones it says cannot fit (`--sweep-force` runs them anyway). A try "trains" when every step was logged
without an OOM; the final checkpoint of a full fine-tune (12 bytes per parameter) may not fit the disk, which the
result notes but does not count against the fit. Models built only for the sweep are deleted after their tries.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

# The pieces, next to this script (bench/ is sys.path[0] when it runs): low_memory_machine.py (paths, GPU, versions,
# child environment), low_memory_model.py (shapes, model build, data stores), low_memory_phase.py (one phase: its
# arguments, plan, child process, metrics, failure reason), low_memory_sweep.py (--full-ft-sweep), low_memory_report.py
# (low_memory.json and the markdown table). This module runs the phases of one shape and holds the command line.
from low_memory_machine import child_env, git_commit, gpu_info, host_ram_gib, versions
from low_memory_model import RUN_SIZES, SHAPES, build_random_llama, build_stores, ensure_model, params_of
from low_memory_phase import PHASES, collect_plan, failure_reason, phase_argv, run_phase, start_plan
from low_memory_report import markdown, save
from low_memory_sweep import run_sweep

# this module's own names, and those tests/ops/test_low_memory_bench.py reaches through it
__all__ = ["RUN_SIZES", "SHAPES", "collect_plan", "failure_reason", "main", "params_of", "parser", "phase_argv",
           "run_phases"]


# ---- the 8B phases -----------------------------------------------------------------------------------------------
def run_phases(args, gpu: dict | None, results: dict) -> None:
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    sizes = dict(RUN_SIZES["tiny" if args.shape == "tiny" else "default"])
    for key in sizes:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    env = child_env(gpu is not None)
    workdir = Path(args.workdir)
    model, build = ensure_model(args, args.shape, gpu is not None)
    stores = build_stores(workdir, model, sizes, args.steps)
    export_rm = args.reward == "rm" and any(p in ("ppo", "grpo") for p in phases)
    key = f"{args.shape}{'-' + args.tag if args.tag else ''}"
    entry = results["runs"].setdefault(key, {"shape": args.shape, "phases": {}})
    entry.update(model=str(model), model_build=build, sizes=sizes, cap_gb=args.cap_gb, reward=args.reward,
                 extra=args.extra,
                 params=params_of(SHAPES[args.shape]) if args.shape in SHAPES else None)
    argvs = {p: phase_argv(args, p, model, stores, sizes, workdir / "runs" / (p if not args.tag else f"{p}-{args.tag}"),
                           gpu is not None, export_rm) for p in phases}
    plans = {} if args.no_plan else {p: start_plan(p, argvs[p], args.cap_gb, gpu and gpu["memory_gib"], env)
                                     for p in phases}
    for p in phases:
        run_dir = Path(argvs[p][argvs[p].index("--run.output_dir") + 1])
        before = entry["phases"].get(p) or {}
        entry["phases"][p] = {"phase": p, "ok": False, "reason": "running (the call ended mid-phase)",
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "previous": before if "exit" in before else before.get("previous")}
        save(args, results)  # replaced when the phase ends: a stopped call shows which phase it was in
        rec = run_phase(args, p, argvs[p], run_dir, env, args.steps)
        if p in plans:
            rec["plan"] = collect_plan(plans[p])
        entry["phases"][p] = rec
        save(args, results)


def parser() -> argparse.ArgumentParser:
    """The command line (its description is this module's docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="8b",
                   help="model for --phases: a random-init Llama shape (8b = Llama-3 8B), or the offline tiny model "
                        "(CPU check)")
    p.add_argument("--cap-gb", type=float, default=24.0,
                   help="run.max_gpu_memory_gb for every phase, and the line the NVML peak is checked against; 0 = "
                        "no cap (default 24)")
    p.add_argument("--phases", default="sft,rm,ppo,grpo", help="comma list of sft, rm, ppo, grpo, run in this order")
    p.add_argument("--steps", type=int, default=3, help="optimizer (SFT/RM) or RL steps per phase (default 3)")
    p.add_argument("--reward", default="bench",
                   help="RL reward: bench (bench/bench_rewards.py:distinct_ratio, in-process), rm (the rm phase's "
                        "export as reward.model: the rm phase then exports, and must run first), or any "
                        "reward.fn value (the random prompts have no ground truth: gsm8k-style rules fail)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="SFT row / preference response tokens (512; tiny 64)")
    p.add_argument("--batch", type=int, help="SFT rows / RM pairs per optimizer step, one micro-batch (8; tiny 4)")
    p.add_argument("--prompt-len", dest="prompt_len", type=int, help="RL prompt tokens (128; tiny 32)")
    p.add_argument("--new-tokens", dest="new_tokens", type=int, help="rollout.max_new_tokens (256; tiny 16)")
    p.add_argument("--prompts", type=int, help="rl.prompts_per_step (8; tiny 2)")
    p.add_argument("--samples", type=int, help="rollout.n_samples (4; tiny 2)")
    p.add_argument("--vllm-util", type=float, help="rollout.gpu_memory_utilization, vLLM's share of the cap "
                                                   "(default: the recipe's 0.85)")
    p.add_argument("--eager", action="store_true", help="rollout.enforce_eager: no CUDA graphs / compile (faster "
                                                        "start, slower decode)")
    p.add_argument("--rollout-backend", default="", help="rollout.backend (default: the recipe's auto = vLLM where "
                                                         "installed; hf for a quicker CPU check)")
    p.add_argument("--extra", default="", help="extra CLI overrides for every phase, one string, e.g. "
                                               "--extra \"--model.quantize_base nf4\"")
    p.add_argument("--phase-extra", action="append", default=[], metavar="PHASE=ARGS",
                   help="extra overrides for one phase, repeatable, e.g. --phase-extra \"ppo=--critic.init actor\"")
    p.add_argument("--tag", default="", help="name of this set of runs in the JSON (default: the shape); runs with "
                                             "a tag get their own run directories")
    p.add_argument("--phase-timeout", type=float, default=540,
                   help="seconds before a phase is stopped and recorded as a timeout (0 = none; default 540, inside "
                        "a 10-minute device command)")
    p.add_argument("--no-plan", action="store_true", help="skip the `ds-rlhf memory` plan of each phase")
    p.add_argument("--sample-period", type=float, default=0.1, help="NVML sampling period in seconds (0.1)")
    p.add_argument("--tail-lines", type=int, default=30, help="log lines kept for a failed phase (30)")
    p.add_argument("--full-ft-sweep", action="store_true",
                   help="instead of --phases: which Llama shapes train with full fine-tuning on this GPU")
    p.add_argument("--sweep-shapes", default="3b,8b,13b,20b",
                   help=f"shapes for --full-ft-sweep, smallest first (of {', '.join(SHAPES)}; default 3b,8b,13b,20b)")
    p.add_argument("--sweep-modes", default="plain,offload",
                   help="plain: ZeRO-3 on the GPU (ds_configs/zero3.json); offload: ZeRO-3 with optimizer and weights "
                        "in host memory (the recipe's JSON)")
    p.add_argument("--sweep-steps", type=int, default=2, help="SFT steps per sweep try (2)")
    p.add_argument("--sweep-force", action="store_true", help="run sweep tries the planner says cannot fit")
    p.add_argument("--keep-models", action="store_true", help="keep the models built only for the sweep")
    p.add_argument("--workdir", default="/tmp/ds_rlhf_lowmem",
                   help="models, data, run directories and the accumulated low_memory.json")
    p.add_argument("--fresh", action="store_true", help="start a new low_memory.json instead of adding to it")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where low_memory.json is written ($OUT)")
    p.add_argument("--build-model", default="", help=argparse.SUPPRESS)  # internal: the child that builds a model
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.build_model:
        print(build_random_llama(args.build_model, workdir / f"llama-{args.build_model}"))
        return
    bad = [x for x in args.phases.split(",") if x.strip() and x.strip() not in PHASES]
    if bad:
        p.error(f"--phases: unknown {bad}; choose from {', '.join(PHASES)}")
    if args.reward == "rm" and "rm" not in args.phases and not (workdir / "runs" / "rm" / "export").exists():
        p.error("--reward rm needs the rm phase's export: include rm in --phases (before ppo/grpo)")
    if args.shape not in SHAPES and args.shape != "tiny":
        p.error(f"--shape {args.shape}")
    gpu = gpu_info()
    state = workdir / "low_memory.json"
    results = {"runs": {}, "commands": []}
    if state.exists() and not args.fresh:
        with contextlib.suppress(ValueError):
            results = json.loads(state.read_text())
    results.update(date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), commit=git_commit(),
                   machine={"gpu": gpu, "cpus": os.cpu_count(), "ram_gib": host_ram_gib(), "versions": versions()})
    results.setdefault("runs", {})
    results.setdefault("commands", []).append(shlex.join(["python3", "bench/low_memory_gpu.py", *sys.argv[1:]]))
    t0 = time.time()
    if args.full_ft_sweep:
        run_sweep(args, gpu, results)
    else:
        run_phases(args, gpu, results)
    results["last_invocation_seconds"] = time.time() - t0
    save(args, results)
    print(markdown(results), flush=True)


if __name__ == "__main__":
    main()
