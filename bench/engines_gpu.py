"""Throughput and peak memory of DeepSpeed training steps for a 0.5B Qwen2-shaped model: ZeRO-2, ZeRO-3, ZeRO-3+offload.

Each configuration runs in its own subprocess (so ``torch.cuda.max_memory_allocated`` is per configuration and a
failure in one does not stop the others), world size 1, random init from config (no download), gradient
checkpointing on (non-reentrant), B=8 x T=1024 by default, a few warm-up steps then timed steps. The engines come
from ``ds_rlhf.engines`` with ``ds_configs/<name>.json`` resolved as the trainer resolves them.

Reported per configuration:
- ``tokens_per_s`` = B*T*timed_steps / wall time of the timed steps (synchronised);
- ``tflops`` = 6*N*tokens_per_s / 1e12 with N = parameter count (tied embedding counted once): the usual
  "model FLOPs" (forward 2N + backward 4N per token), *excluding* attention-score FLOPs and the recompute of
  gradient checkpointing; ``tflops_with_attn`` adds 12*L*h*T per token (QK^T and AV, forward + backward);
- ``peak_mem_bytes`` = ``torch.cuda.max_memory_allocated()`` (GPU) or the process's peak RSS (CPU, ``--tiny``).

    python bench/engines_gpu.py [--configs zero2,zero3,zero3_offload] [--json out.json]   # on the GPU box
    python bench/engines_gpu.py --tiny --steps 2 --warmup 1                                # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {"zero2": ("zero2", False), "zero3": ("zero3", False), "zero3_offload": ("zero3_offload", True)}
SHAPES = {
    # Qwen2-0.5B's published shape.
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=2048),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape, for a CPU smoke run")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=None, help="micro batch (default 8; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attn", default="sdpa", help="attention implementation ('auto' = select_attn_impl)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--timeout", type=int, default=1500, help="seconds per configuration")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq = args.seq or (64 if args.tiny else 1024)
    return args


def _single_process_env() -> None:
    from ds_rlhf.distributed import free_port

    for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                           LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(args) -> dict:
    """One configuration, in this process."""
    _single_process_env()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ds_rlhf.engines.attention import select_attn_impl
    from ds_rlhf.engines.builder import build_engine, ensure_distributed
    from ds_rlhf.engines.ds_config import load_ds_config, pick_precision, resolve_ds_config
    from ds_rlhf.engines.memory import count_params, memory_breakdown
    from ds_rlhf.engines.models import GC_KWARGS, as_dtype

    file, offload = CONFIGS[args.worker]
    ensure_distributed()
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    precision = pick_precision(args.precision)
    shape = SHAPES["tiny" if args.tiny else "0.5b"]
    config = Qwen2Config(**shape, use_cache=False)
    config._attn_implementation = select_attn_impl(args.attn, device=device, dtype=as_dtype(precision))
    cfg = resolve_ds_config(load_ds_config(file), micro_batch_size=args.batch, grad_accum=1, world_size=1,
                            precision=precision, grad_clip=1.0, lr=1e-5, weight_decay=0.0,
                            hidden_size=shape["hidden_size"], offload=offload)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(as_dtype(precision))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=GC_KWARGS)
    n_params, _ = count_params(model)
    engine = build_engine(model, cfg, role="actor")
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=gen).to(engine.device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    losses, elapsed = _train_steps(engine, batch, args.warmup, args.steps, sync)
    tokens = args.batch * args.seq * args.steps
    tps = tokens / elapsed
    attn_flops = 12 * shape["num_hidden_layers"] * shape["hidden_size"] * args.seq
    estimate = memory_breakdown(engine, zero_stage=cfg["zero_optimization"]["stage"], world_size=1,
                                micro_batch_tokens=args.batch * args.seq, offload=offload,
                                gradient_checkpointing=True)
    return {
        "config": args.worker, "ds_config_file": f"ds_configs/{file}.json", "device": _device_name(on_gpu),
        "precision": precision, "attn": config._attn_implementation, "params": n_params,
        "batch": args.batch, "seq": args.seq, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "step_s": elapsed / args.steps, "tokens_per_s": tps, "tflops": 6 * n_params * tps / 1e12,
        "tflops_with_attn": (6 * n_params + attn_flops) * tps / 1e12,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if on_gpu else _peak_rss_bytes(),
        "peak_mem_kind": "cuda.max_memory_allocated" if on_gpu else "process peak RSS",
        "estimated_device_bytes": estimate["device_total"], "estimated_host_bytes": estimate["host_total"],
        "losses": losses, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }


def _train_steps(engine, batch, warmup: int, steps: int, sync) -> tuple[list[float], float]:
    """`warmup` + `steps` training steps on `batch`; every step's loss, and the seconds of the timed `steps`."""
    losses, start = [], None
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    sync()
    return losses, time.perf_counter() - start


def _device_name(on_gpu: bool) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if on_gpu else f"cpu ({platform.processor() or platform.machine()})"


def run_config(name: str, args, argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"config": name, "error": f"timed out after {args.timeout}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"config": name, "error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return []
    names = [c for c in args.configs.split(",") if c]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    results = []
    for name in names:
        res = run_config(name, args, argv)
        results.append(res)
        if "error" in res:
            print(f"{name:14s} FAILED: {res['error']}\n{res.get('tail', '')[-1500:]}", flush=True)
        else:
            print(f"{name:14s} {res['tokens_per_s']:10.1f} tok/s  {res['tflops']:7.2f} TFLOP/s (6N)  "
                  f"{res['tflops_with_attn']:7.2f} (+attn)  peak {res['peak_mem_bytes'] / 2**30:7.2f} GiB "
                  f"({res['peak_mem_kind']})  step {res['step_s']:.3f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
