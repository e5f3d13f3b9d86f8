"""Low-memory benchmark (issue 16): SFT, RM, PPO and GRPO steps of an 8B Llama-3 shape under a GPU memory cap.

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
of --prompt-len (`rl_step_gpu.build_prompts`). Rewards: `bench/bench_rewards.py:distinct_ratio` by default (cheap,
varies between samples), any `rl.reward_fn`, or `--reward rm` (the rm phase's export as `rl.reward_model`).

Results accumulate in WORKDIR/low_memory.json across invocations (one device command is limited to 10 minutes, so
run the phases in separate commands on the same machine); each invocation writes the merged file to
OUT/low_memory.json and prints a markdown table of every phase recorded so far (for docs/PERFORMANCE.md).

On the GPU machine (DeepSpeed and vLLM on PYTHONPATH as the device recipe puts them):

    python3 bench/low_memory_gpu.py --shape 8b --phases sft --steps 3 --out $OUT        # builds /tmp/ds_rlhf_lowmem
    python3 bench/low_memory_gpu.py --shape 8b --phases rm,grpo --steps 3 --out $OUT
    python3 bench/low_memory_gpu.py --shape 8b --phases ppo --steps 3 --out $OUT
    python3 bench/low_memory_gpu.py --shape 8b --phases grpo --extra "--model.quantize_base nf4" --tag nf4 --out $OUT
    python3 bench/low_memory_gpu.py --full-ft-sweep --out $OUT       # largest full-FT model: 8b, 13b, 20b shapes
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
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
RECIPE = "ds_configs/low_memory_24g.yaml"
GiB = 1 << 30

# Llama shapes, vocab 128256 (Llama-3 tokenizer size); "8b" is issue 16's shape.
LLAMA = dict(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
SHAPES = {
    "1b": dict(LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192,
               tie_word_embeddings=True),
    "3b": dict(LLAMA, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, intermediate_size=8192,
               tie_word_embeddings=True),
    "8b": dict(LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
               tie_word_embeddings=False),
    "13b": dict(LLAMA, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824,
                tie_word_embeddings=False),  # ~12.3B with GQA-8
    "20b": dict(LLAMA, hidden_size=6144, num_hidden_layers=48, num_attention_heads=48, intermediate_size=16384,
                tie_word_embeddings=False),  # ~20.3B
}
# Sizes of one phase per shape: sequence lengths, SFT/RM batch, RL prompts x samples.
RUN_SIZES = {
    "tiny": dict(seq_len=64, prompt_len=32, new_tokens=16, batch=4, prompts=2, samples=2),
    "default": dict(seq_len=512, prompt_len=128, new_tokens=256, batch=8, prompts=8, samples=4),
}
PHASES = {"sft": "train-sft", "rm": "train-rm", "ppo": "train-ppo", "grpo": "train-ppo"}
PLAN_KIND = {"sft": "sft", "rm": "rm", "ppo": "rl", "grpo": "rl"}
BENCH_REWARD = f"{BENCH / 'bench_rewards.py'}:distinct_ratio"


# ---- the machine -------------------------------------------------------------------------------------------------
def gpu_info() -> dict | None:
    """Name and memory of GPU 0 from nvidia-smi (no CUDA context in this process), or None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits", "--id=0"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = [p.strip() for p in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(parts) < 3:
        return None
    try:
        return {"name": parts[0], "memory_gib": float(parts[1]) / 1024, "driver": parts[2]}
    except ValueError:
        return None


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "deepspeed", "vllm", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def child_env(gpu: bool) -> dict:
    """This environment without a launcher's distributed variables (each phase is a world of one on its own port),
    the checkout on PYTHONPATH, offline hubs, and the CPU settings of scripts/env.sh when there is no GPU."""
    from ds_rlhf.distributed import clean_dist_env

    env = clean_dist_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    for k, v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", PYTHONUNBUFFERED="1").items():
        env.setdefault(k, v)
    if not gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


# ---- model and data ----------------------------------------------------------------------------------------------
def params_of(shape: dict) -> int:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if shape["tie_word_embeddings"] else 2) + h


def build_random_llama(shape_name: str, out: Path) -> Path:
    """Random-init Llama of SHAPES[shape_name] in bf16, saved as safetensors with the tiny tokenizer. Built on the GPU
    when there is one (meta device -> to_empty -> normal_(0, 0.02), norms 1), written to a temp dir then renamed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ds_rlhf.engines.tiny_models import build_tiny_model

    if (out / "BUILT").exists():
        return out
    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    config = LlamaConfig(**SHAPES[shape_name], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
    tok.save_pretrained(tmp)
    (tmp / "BUILT").write_text(json.dumps({"shape": shape_name, "params": sum(p.numel() for p in model.parameters()),
                                           "seconds": time.time() - t0}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def ensure_model(args, shape_name: str, gpu: bool) -> tuple[Path, dict]:
    """The model directory (built in a child process, so no CUDA context stays in this one during the phases)."""
    if shape_name == "tiny":
        from ds_rlhf.engines.tiny_models import build_tiny_model

        return build_tiny_model(), {"built": False}
    out = Path(args.workdir) / f"llama-{shape_name}"
    if (out / "BUILT").exists():
        return out, {"built": False}
    need = params_of(SHAPES[shape_name]) * 2
    free = shutil.disk_usage(Path(args.workdir)).free
    if free < need * 1.1:
        raise RuntimeError(f"building {shape_name} needs {need / GiB:.1f} GiB of disk in {args.workdir}, "
                           f"{free / GiB:.1f} GiB free")
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-model", shape_name,
                           "--workdir", str(args.workdir)], cwd=ROOT, env=child_env(gpu), capture_output=True,
                          text=True)
    if proc.returncode != 0 or not (out / "BUILT").exists():
        raise RuntimeError(f"building {shape_name} failed (exit {proc.returncode}): "
                           + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-8:]))
    print(f"[low_memory] built {out} in {time.time() - t0:.0f}s", flush=True)
    return out, {"built": True, "build_seconds": time.time() - t0}


def build_stores(workdir: Path, model_dir: Path, sizes: dict, steps: int) -> dict[str, Path]:
    """Random token rows: SFT rows of seq_len (loss on the second half), preference pairs of seq_len each, and
    prompts of prompt_len (`rl_step_gpu.build_prompts`); enough rows for `steps` steps (no eval split)."""
    import random

    from rl_step_gpu import build_prompts
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(model_dir)
    fp = tokenizer_fingerprint(tok)
    n, L = sizes["batch"] * (steps + 1), sizes["seq_len"]
    tag = f"{fp[:8]}-{L}-{n}"
    rng = random.Random(0)
    stores = {}
    sft = workdir / f"data/sft-{tag}"
    if not (sft / "manifest.json").exists():
        rows = [{"input_ids": [rng.randrange(10, 400) for _ in range(L)],
                 "loss_mask": [0] * (L // 2) + [1] * (L - L // 2), "row_id": i, "source_idx": 0} for i in range(n)]
        write_store(sft, "sft", rows, tokenizer_name=str(model_dir), tokenizer_fingerprint=fp)
    stores["sft"] = sft
    pref = workdir / f"data/preference-{tag}"
    if not (pref / "manifest.json").exists():
        rows = [{"chosen_ids": [rng.randrange(10, 400) for _ in range(L)],
                 "rejected_ids": [rng.randrange(10, 400) for _ in range(L)], "row_id": i, "source_idx": 0}
                for i in range(n)]
        write_store(pref, "preference", rows, tokenizer_name=str(model_dir), tokenizer_fingerprint=fp)
    stores["preference"] = pref
    pdir = workdir / f"data/p-{fp[:8]}-{sizes['prompts'] * (steps + 1)}"
    pdir.mkdir(parents=True, exist_ok=True)
    stores["prompts"] = build_prompts(pdir, model_dir, sizes["prompts"] * (steps + 1), sizes["prompt_len"])
    return stores


# ---- one phase ---------------------------------------------------------------------------------------------------
def phase_argv(args, phase: str, model: Path, stores: dict, sizes: dict, run_dir: Path, gpu: bool,
               export_rm: bool) -> list[str]:
    """The CLI arguments of one phase: the recipe, then this benchmark's overrides, then --extra / --phase-extra."""
    a = ["--config", str(ROOT / RECIPE), "--model.path", str(model), "--run.output_dir", str(run_dir),
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
            a += ["--rl.reward_model", str(Path(args.workdir) / "runs" / "rm" / "export")]
        elif args.reward == "bench":
            a += ["--rl.reward_fn", BENCH_REWARD, "--rl.reward_workers", "0"]
        else:
            a += ["--rl.reward_fn", args.reward]
    a += shlex.split(args.extra)
    for item in args.phase_extra:
        name, _, rest = item.partition("=")
        if name == phase:
            a += shlex.split(rest)
    return a


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


def run_phase(args, phase: str, argv: list[str], run_dir: Path, env: dict, steps: int) -> dict:
    """One phase as a child process under the sampler; its record (exit, times, peaks, log tail, config)."""
    from gpu_timeline import Sampler

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "ds_rlhf.entrypoints", PHASES[phase], *argv]
    print(f"[low_memory] {phase}: {shlex.join(cmd[1:])}", flush=True)
    idle = None
    timed_out = False
    t0 = time.time()
    with Sampler(args.sample_period) as sampler:
        if sampler.source:
            time.sleep(max(0.3, 3 * args.sample_period))
            idle = max((s[2] for s in sampler.samples), default=None)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=args.phase_timeout or None)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)  # our own child's session: the trainer and its helpers
                try:
                    rc = proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
        wall = time.time() - t0
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
           "nvml_samples": len(samples),
           "within_cap": (nvml_peak <= args.cap_gb) if (nvml_peak is not None and args.cap_gb) else None,
           "command": shlex.join(["python", "-m", "ds_rlhf.entrypoints", PHASES[phase], *argv]),
           "log": str(log_path), "config": resolved}
    if rc != 0 or reason:
        rec["log_tail"] = [ln for ln in text.strip().splitlines() if ln.strip()][-args.tail_lines:]
        errors = [ln for ln in text.splitlines() if ln.startswith("error:") or "Error" in ln]
        if errors:
            rec["error_line"] = errors[-1][:2000]
    print(f"[low_memory] {phase}: exit {rc} ({reason or 'ok'}), {m['steps_logged']} steps, wall {wall:.0f}s, "
          f"step {_fmt(m['step_time_s'])}s, NVML peak {_fmt(nvml_peak)} GiB", flush=True)
    return rec


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
        rec = run_phase(args, p, argvs[p], run_dir, env, args.steps)
        if p in plans:
            rec["plan"] = collect_plan(plans[p])
        entry["phases"][p] = rec
        save(args, results)


# ---- the full fine-tuning sweep ----------------------------------------------------------------------------------
SWEEP_MODES = {  # mode -> overrides (full fine-tuning, no cap: the whole card)
    "plain": ["--offload", "false", "--ds_config", "ds_configs/zero3.json"],
    "offload": ["--offload", "true", "--ds_config", "ds_configs/low_memory_24g.json"],
}


def host_ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def run_sweep(args, gpu: dict | None, results: dict) -> None:
    env = child_env(gpu is not None)
    workdir = Path(args.workdir)
    sizes = dict(RUN_SIZES["default"], **{k: getattr(args, k) for k in ("seq_len", "batch") if getattr(args, k)})
    sweep = results.setdefault("full_ft_sweep", {})
    card = gpu["memory_gib"] if gpu else None
    steps = args.sweep_steps
    for shape in [s.strip() for s in args.sweep_shapes.split(",") if s.strip()]:
        cfg_dir = workdir / f"config-{shape}"  # a config.json only: what the planner reads
        if not (cfg_dir / "config.json").exists():
            from transformers import LlamaConfig

            LlamaConfig(**SHAPES[shape]).save_pretrained(cfg_dir)
        tries, model, built = {}, None, False
        for mode in [m.strip() for m in args.sweep_modes.split(",") if m.strip()]:
            base = ["--config", str(ROOT / RECIPE), "--model.lora_rank", "0", "--model.share_base", "false",
                    "--run.max_gpu_memory_gb", "0", *SWEEP_MODES[mode], "--optim.batch_size", str(sizes["batch"]),
                    "--optim.micro_batch_size", str(sizes["batch"]), "--data.max_len", str(sizes["seq_len"]),
                    "--data.eval_fraction", "0", "--run.steps", str(steps), "--run.export_hf", "false",
                    "--run.overwrite", "true", "--run.progress", "false", "--run.tensorboard", "false",
                    "--run.log_every", "1", "--run.keep_last", "1", *shlex.split(args.extra)]
            plan = collect_plan(start_plan("sft", ["--model.path", str(cfg_dir), *base], 0, card or 141.0, env))
            host_ok = plan.get("host_gib", 0) <= host_ram_gib() * 0.9
            t = {"mode": mode, "plan": plan, "host_ram_gib": host_ram_gib(), "planned_fit": bool(plan.get("fits"))
                 and host_ok}
            if not t["planned_fit"] and not args.sweep_force:
                t["skipped"] = ("planner: " + ("device" if not plan.get("fits") else "host") + " memory does not fit")
                print(f"[low_memory] sweep {shape}/{mode}: skipped ({t['skipped']})", flush=True)
                tries[mode] = t
                continue
            if model is None:
                try:
                    model, info = ensure_model(args, shape, gpu is not None)
                    built = info["built"]
                except RuntimeError as exc:
                    t["skipped"] = str(exc)
                    tries[mode] = t
                    break
                stores = build_stores(workdir, model, sizes, steps)
            run_dir = workdir / "runs" / f"fullft-{shape}-{mode}"
            argv = ["--model.path", str(model), "--data.train", str(stores["sft"]), "--run.output_dir", str(run_dir),
                    *base]
            rec = {**run_phase(args, "sft", argv, run_dir, env, steps), "within_cap": None}  # no cap here
            # every step logged without running out of memory; a final checkpoint the disk cannot hold is noted only
            rec["trains"] = rec["steps_logged"] >= steps and rec["reason"] in (None, "disk (checkpoint)")
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # full-FT optimizer states: disk
            tries[mode] = {**t, **rec}
            sweep[shape] = {"params": params_of(SHAPES[shape]), "tries": tries}
            save(args, results)
        sweep[shape] = {"params": params_of(SHAPES[shape]), "tries": tries,
                        "trains": any(t.get("trains") for t in tries.values())}
        if built and not args.keep_models and shape != args.shape:
            shutil.rmtree(model, ignore_errors=True)
        save(args, results)
    fitting = [s for s, r in sweep.items() if r.get("trains")]
    results["full_ft_largest"] = max(fitting, key=lambda s: sweep[s]["params"]) if fitting else None


# ---- output ------------------------------------------------------------------------------------------------------
def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(results: dict) -> str:
    m = results["machine"]
    gpu = m.get("gpu")
    hw = (f"{gpu['name']} ({gpu['memory_gib']:.0f} GiB), driver {gpu['driver']}" if gpu else "no GPU (CPU)") + (
        f", {m['cpus']} cores, {m['ram_gib']:.0f} GiB RAM")
    v = m["versions"]
    lines = [f"Low-memory benchmark (`bench/low_memory_gpu.py`), {results['date']}, commit {results.get('commit')}",
             "", f"- hardware: {hw}",
             "- software: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"- command(s): {'; '.join(f'`{c}`' for c in results['commands'])}"]
    for key, run in results.get("runs", {}).items():
        s = run["sizes"]
        size = f"{run['params'] / 1e9:.2f}B parameters" if run.get("params") else "the offline tiny model"
        lines += ["", f"**{key}** ({size}, random init; cap "
                  f"{run['cap_gb']:g} GiB; SFT/RM {s['batch']} x {s['seq_len']} tokens per step; RL "
                  f"{s['prompts']} prompts x {s['samples']} samples, {s['prompt_len']} + {s['new_tokens']} tokens; "
                  f"reward {run['reward']}{'; extra ' + repr(run['extra']) if run['extra'] else ''})", "",
                  "| phase | exit | steps | step time (s, median) | wall (s) | NVML peak (GiB) | torch peak (GiB) | "
                  "host RSS peak (GiB) | <= cap | planned peak (GiB) | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in run["phases"].items():
            plan = r.get("plan") or {}
            note = r.get("reason") or ""
            if r.get("error_line") and r.get("reason"):
                note += ": " + r["error_line"][:160].replace("|", "/")
            lines.append(f"| {p} | {r['exit']} | {r['steps_logged']} | {_fmt(r['step_time_s'])} | "
                         f"{_fmt(r['wall_s'])} | {_fmt(r['nvml_peak_gib'])} | {_fmt(r['torch_peak_gib'])} | "
                         f"{_fmt(r['host_rss_peak_gib'])} | {_fmt(r['within_cap'])} | "
                         f"{_fmt(plan.get('peak_gib'))} | {note} |")
    sweep = results.get("full_ft_sweep")
    if sweep:
        lines += ["", "**Full fine-tuning (no LoRA, no cap), SFT steps, ZeRO-3 plain / with offload**", "",
                  "| shape | params (B) | mode | planned device / host (GiB) | trains | step time (s) | "
                  "NVML peak (GiB) | host RSS peak (GiB) | note |", "|---|---|---|---|---|---|---|---|---|"]
        for shape, r in sweep.items():
            for mode, t in r["tries"].items():
                plan = t.get("plan") or {}
                note = t.get("skipped") or t.get("reason") or ""
                lines.append(f"| {shape} | {r['params'] / 1e9:.1f} | {mode} | {_fmt(plan.get('peak_gib'))} / "
                             f"{_fmt(plan.get('host_gib'))} | {_fmt(t.get('trains'))} | {_fmt(t.get('step_time_s'))}"
                             f" | {_fmt(t.get('nvml_peak_gib'))} | {_fmt(t.get('host_rss_peak_gib'))} | {note} |")
        lines += ["", f"Largest model that trains with full fine-tuning: {results.get('full_ft_largest') or 'none'}"]
    return "\n".join(lines)


def save(args, results: dict) -> None:
    text = json.dumps(results, indent=1, default=str)
    state = Path(args.workdir) / "low_memory.json"
    state.write_text(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "low_memory.json").write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="8b",
                   help="model for --phases: a random-init Llama shape (8b = issue 16's), or the offline tiny model "
                        "(CPU check)")
    p.add_argument("--cap-gb", type=float, default=24.0,
                   help="run.max_gpu_memory_gb for every phase, and the line the NVML peak is checked against; 0 = "
                        "no cap (default 24)")
    p.add_argument("--phases", default="sft,rm,ppo,grpo", help="comma list of sft, rm, ppo, grpo, run in this order")
    p.add_argument("--steps", type=int, default=3, help="optimizer (SFT/RM) or RL steps per phase (default 3)")
    p.add_argument("--reward", default="bench",
                   help="RL reward: bench (bench/bench_rewards.py:distinct_ratio, in-process), rm (the rm phase's "
                        "export as rl.reward_model: the rm phase then exports, and must run first), or any "
                        "rl.reward_fn value (the random prompts have no ground truth: gsm8k-style rules fail)")
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
                   help="extra overrides for one phase, repeatable, e.g. --phase-extra \"ppo=--rl.critic_init actor\"")
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
    p.add_argument("--sweep-shapes", default="8b,13b,20b",
                   help=f"shapes for --full-ft-sweep, smallest first (of {', '.join(SHAPES)}; default 8b,13b,20b)")
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
