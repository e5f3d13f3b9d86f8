"""One phase of bench/low_memory_gpu.py: its CLI arguments (the recipe plus this benchmark's overrides), its
`ds-rlhf memory --json` plan, the child process under the NVML sampler, the summary of its metrics.jsonl and the
one-word reason of a failure."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from low_memory_machine import BENCH, ROOT, GiB
from low_memory_report import fmt

from ds_rlhf.config import load_file
from ds_rlhf.config_keys import recipe_view

RECIPE = "ds_configs/low_memory_24g.yaml"
PHASES = {"sft": "train-sft", "rm": "train-rm", "ppo": "train-ppo", "grpo": "train-ppo"}
PLAN_KIND = {"sft": "sft", "rm": "rm", "ppo": "rl", "grpo": "rl"}
BENCH_REWARD = f"{BENCH / 'bench_rewards.py'}:distinct_ratio"


def phase_argv(args, phase: str, model: Path, stores: dict, sizes: dict, run_dir: Path, gpu: bool,
               export_rm: bool) -> list[str]:
    """The CLI arguments of one phase: the recipe (the sections its command reads), then this benchmark's overrides,
    then --extra / --phase-extra."""
    a = ["--config", phase_recipe(phase, run_dir.parent), "--model.path", str(model), "--run.output_dir", str(run_dir),
         "--run.steps", str(args.steps), "--run.overwrite", "true", "--run.progress", "false",
         "--run.tensorboard", "false", "--run.log_every", "1", "--run.keep_last", "1",
         "--run.max_gpu_memory_gb", f"{args.cap_gb:g}"]
    if phase in ("sft", "rm"):
        a += ["--data.train", str(stores["sft" if phase == "sft" else "preference"]), "--data.eval_fraction", "0",
              "--data.max_len", str(max(sizes["seq_len"], 2)),
              "--optim.batch_size", str(sizes["batch"]), "--optim.micro_batch_size", str(sizes["batch"]),
              "--run.export_hf", str(phase == "rm" and export_rm).lower()]
    else:
        a += ["--data.train", str(stores["prompts"]), "--rl.algo", phase, "--data.max_prompt_len",
              str(sizes["prompt_len"]), "--rl.prompts_per_step", str(sizes["prompts"]), "--rollout.n_samples",
              str(sizes["samples"]), "--rollout.max_new_tokens", str(sizes["new_tokens"]), "--run.export_hf", "false",
              "--run.profile_memory", "true"]
        if args.rollout_backend:
            a += ["--rollout.backend", args.rollout_backend]
        if args.vllm_util is not None:
            a += ["--rollout.gpu_memory_utilization", str(args.vllm_util)]
        if args.eager:
            a += ["--rollout.enforce_eager", "true"]
        if args.reward == "rm":
            a += ["--reward.model", str(Path(args.workdir) / "runs" / "rm" / "export")]
        elif args.reward == "bench":
            a += ["--reward.fn", BENCH_REWARD, "--reward.workers", "0"]
        else:
            a += ["--reward.fn", args.reward]
    a += shlex.split(args.extra)
    for item in args.phase_extra:
        name, _, rest = item.partition("=")
        if name == phase:
            a += shlex.split(rest)
    return a


def phase_recipe(phase: str, where: Path) -> str:
    """The recipe file for one phase: the recipe itself for RL, else a copy under `where` without the sections its
    command does not read (train-sft and train-rm refuse the rollout and RL settings)."""
    if PHASES[phase] == "train-ppo":
        return str(ROOT / RECIPE)
    path = Path(where) / f"low_memory_24g.{PHASES[phase]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe_view(load_file(ROOT / RECIPE), PHASES[phase]), sort_keys=False))
    return str(path)


def start_plan(phase: str, argv: list[str], cap_gb: float, gpu_gib: float | None, env: dict):
    """`ds-rlhf memory --json` for this phase's arguments, for a GPU of the cap (or the card without one)."""
    gb = cap_gb or gpu_gib or 24.0
    cmd = [sys.executable, "-m", "ds_rlhf.entrypoints", "memory", "--kind", PLAN_KIND[phase], "--json",
           "--gpu-memory-gb", f"{gb:g}", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect_plan(proc) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": "timeout"}
    try:
        plan = json.loads(out[out.index("{"):])
    except ValueError:
        return {"error": (err or out).strip().splitlines()[-1:] or ["no output"], "exit": proc.returncode}
    roles = {r["role"]: {"device_gib": r["device_total"] / GiB, "host_gib": r["host"] / GiB,
                         "params": r["num_params"], "detail": r["detail"]} for r in plan["roles"]}
    return {"fits": plan["fits"], "exit": proc.returncode, "capacity_gib": plan["settings"]["capacity"] / GiB,
            "peak_gib": plan["peak"] / GiB, "reserve_gib": plan["settings"]["reserve"] / GiB,
            "phases_gib": {k: v / GiB for k, v in plan["phases"].items()}, "host_gib": plan["host_per_rank"] / GiB,
            "roles": roles, "notes": list(plan.get("notes", []))}


def failure_reason(rc: int, log: str, timed_out: bool) -> str | None:
    if rc == 0:
        return None
    if timed_out:
        return "timeout"
    low = log.lower()
    if "error: run.max_gpu_memory_gb=" in log:  # the cap preflight refused the plan, before loading anything
        return "cap refused"
    if "out of memory" in low or "outofmemoryerror" in low:
        return "OOM"
    if rc in (-signal.SIGKILL, 137):
        return "killed (host OOM?)"
    if "not enough space to save checkpoint" in log or "No space left on device" in log:
        return "disk (checkpoint)"
    return "error"


def metrics_summary(run_dir: Path) -> dict:
    from ds_rlhf.telemetry.logger import read_metrics

    try:
        records = [r for r in read_metrics(run_dir) if "time/wall" in r]
    except (OSError, ValueError):
        records = []
    out: dict = {"steps_logged": len(records), "step_seconds": [r["time/wall"] for r in records]}
    steady = records[1:] or records
    times = sorted({k for r in steady for k in r if k.startswith("time/")})
    out["time_median"] = {k: statistics.median(r[k] for r in steady if isinstance(r.get(k), int | float))
                          for k in times if any(isinstance(r.get(k), int | float) for r in steady)}
    out["step_time_s"] = out["time_median"].get("time/wall")

    def peak(key):
        vals = [r[key] for r in records if isinstance(r.get(key), int | float)]
        return max(vals) if vals else None

    out["torch_peak_gib"] = peak("sys/gpu_mem_peak_gb")
    out["nvml_logged_gib"] = peak("sys/gpu_mem_used_gb")
    out["host_rss_peak_gib"] = peak("sys/cpu_max_rss_gb")
    mem = sorted({k for r in records for k in r if k.startswith("memory/") and k.endswith("_gib")})
    out["profile_memory"] = {k: peak(k) for k in mem}
    return out


def peak_time(samples: list, t0: float) -> dict:
    """When NVML read its peak (UTC, to line up with the log's timestamps) and the memory per second of the phase
    (the highest sample of each second since `t0`, GiB): where in the step the peak falls."""
    if not samples:
        return {}
    t, _, peak = max(samples, key=lambda s: s[2])
    per_second: dict[int, float] = {}
    for ts, _, mem in samples:
        second = int(ts - t0)
        per_second[second] = max(per_second.get(second, 0.0), mem)
    return {"nvml_peak_utc": time.strftime("%H:%M:%S", time.gmtime(t)), "nvml_peak_after_s": round(t - t0, 1),
            "nvml_per_second_gib": [round(per_second[k], 2) for k in sorted(per_second)]}


def _wait(proc: subprocess.Popen, timeout: float | None) -> tuple[int, bool]:
    """The phase's exit status, and whether it ran past `timeout`: then its session (the trainer and its helpers,
    our own child's) gets SIGTERM, and SIGKILL 30 s later."""
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # our own child's session: the trainer and its helpers
        try:
            return proc.wait(timeout=30), True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True


def run_phase(args, phase: str, argv: list[str], run_dir: Path, env: dict, steps: int) -> dict:
    """One phase as a child process under the sampler; its record (exit, times, peaks, log tail, config)."""
    from gpu_timeline import Sampler

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    # written to OUT/logs as the phase runs (a device call stopped mid-phase still brings back what it printed),
    # copied beside the run directory when it ends (OUT is a fresh folder per device call; the workdir stays)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    out = Path(args.out).resolve() if args.out else ROOT.resolve()
    live = log_path if out == ROOT.resolve() else out / "logs" / log_path.name  # OUT = the checkout: beside the run
    live.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ds_rlhf.entrypoints", PHASES[phase], *argv]
    print(f"[low_memory] {phase}: {shlex.join(cmd[1:])}", flush=True)
    idle = None
    t0 = time.time()
    with Sampler(args.sample_period) as sampler:
        if sampler.source:
            time.sleep(max(0.3, 3 * args.sample_period))
            idle = max((s[2] for s in sampler.samples), default=None)
        with open(live, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            rc, timed_out = _wait(proc, args.phase_timeout or None)
        wall = time.time() - t0
    if live != log_path:
        shutil.copyfile(live, log_path)
    text = log_path.read_text(errors="replace")
    samples = [s for s in sampler.samples if s[0] >= t0]
    nvml_peak = max((s[2] for s in samples), default=None)
    m = metrics_summary(run_dir)
    try:
        resolved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        resolved = None
    reason = failure_reason(rc, text, timed_out)
    if reason is None and m["steps_logged"] < steps:
        reason = "steps missing"
    rec = {"phase": phase, "exit": rc, "ok": rc == 0 and m["steps_logged"] >= steps, "reason": reason,
           "wall_s": wall, **m, "nvml_source": sampler.source, "nvml_peak_gib": nvml_peak, "nvml_idle_gib": idle,
           "nvml_samples": len(samples), **peak_time(samples, t0),
           "within_cap": (nvml_peak <= args.cap_gb) if (nvml_peak is not None and args.cap_gb) else None,
           "command": shlex.join(["python", "-m", "ds_rlhf.entrypoints", PHASES[phase], *argv]),
           "log": str(log_path), "config": resolved}
    if rc != 0 or reason:
        rec["log_tail"] = [ln for ln in text.strip().splitlines() if ln.strip()][-args.tail_lines:]
        errors = [ln for ln in text.splitlines() if ln.startswith("error:") or "Error" in ln]
        if errors:
            rec["error_line"] = errors[-1][:2000]
    print(f"[low_memory] {phase}: exit {rc} ({reason or 'ok'}), {m['steps_logged']} steps, wall {wall:.0f}s, "
          f"step {fmt(m['step_time_s'])}s, NVML peak {fmt(nvml_peak)} GiB", flush=True)
    return rec
