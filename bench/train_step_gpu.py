"""Training-phase benchmark: `policy_update` (GRPO, one epoch) on a synthetic trajectory, no rollout engine.

It isolates what `bench/rl_step_gpu.py` reports as `time/train`: the same actor engine (DeepSpeed, the ds_config
given), the same micro-batching and log-prob head, 256 samples of 128 prompt + 256 response tokens by default.
Each `--micro-batch-tokens` value is measured after one warm-up update; `--profile` prints the top CUDA kernels of
one update. MFU = 6 * N * tokens / seconds over the 790 TFLOP/s bf16 peak (N = parameters, tied head once).

    python3 bench/train_step_gpu.py --model 0.5b --micro-batch-tokens 16384,32768,65536 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_inputs import build_model
from rl_step_gpu import full_head
from train_figures import kernels_used, train_mfu_params

PEAK_TFLOPS = 790.0


def synthetic_trajectory(cfg, n: int, prompt: int, response: int, vocab: int, device):
    """n samples of random token ids (8 per prompt, the group sharing its prompt's tokens), random rewards, GRPO
    advantages."""
    import torch

    from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
    from ds_rlhf.rollout.base import RolloutSample

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (prompt,), generator=gen).tolist() for _ in range(-(-n // 8))]
    samples = [RolloutSample(prompt_index=i // 8, sample_index=i % 8, prompt_ids=prompts[i // 8],
                             response_ids=torch.randint(10, vocab, (response,), generator=gen).tolist(),
                             logprobs=[-11.0] * response, finish_reason="length") for i in range(n)]
    scores = torch.rand(n, generator=gen).tolist()
    return with_advantages(pad_trajectory(samples, scores, 0, device=device), cfg.rl, 0.0)


def _patch_head(backward: str, chunk: int, eager: bool) -> None:
    """Benchmark-only switches, to measure the alternatives back to back on one machine."""
    import functools

    from ds_rlhf.algos import logprobs
    from ds_rlhf.engines import policy_forward, shared_prompt
    from ds_rlhf.recipes import policy_update as rl_update

    if backward == "fp32":
        logprobs._low_precision = lambda weight: False
    if eager:
        logprobs._fused = lambda fn, device: fn
    if chunk:
        rl_update.sequence_logprobs = functools.partial(policy_forward.sequence_logprobs, chunk_size=chunk)
        rl_update.shared_prompt_logprobs = functools.partial(shared_prompt.shared_prompt_logprobs, chunk_size=chunk)


def _time_optimizer_steps(actor, sync) -> list[float]:
    """Wrap `actor.step` (the optimizer step, once per mini-batch) to record its synchronised seconds."""
    seconds: list[float] = []
    inner = actor.step

    def timed_step(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        sync()
        seconds.append(time.perf_counter() - t0)
        return out

    actor.step = timed_step
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", default="32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ds-config", default="ds_configs/zero2.json")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the optimizer step (DeepSpeed's engine.step, synchronised) apart from the "
                        "forward/backward passes, in the timed updates (the syncs add a little to the total)")
    p.add_argument("--tiny", action="store_true", help="CPU logic check with the tiny model")
    p.add_argument("--head-backward", choices=("auto", "fp32"), default="auto",
                   help="fp32: the chunked log-prob head's backward GEMMs in fp32 (slower; for comparison)")
    p.add_argument("--head-chunk", type=int, default=0, help="log-prob head chunk (tokens); 0 = the trainer's")
    p.add_argument("--head-eager", action="store_true", help="the head's per-logit work without torch.compile")
    p.add_argument("--packing", action="store_true", help="data.rl_packing: one padding-free row per micro-batch")
    p.add_argument("--shared-prompt", choices=("auto", "on", "off"), default="auto",
                   help="data.rl_shared_prompt: each group's prompt forwarded once (auto: as the trainer resolves it)")
    p.add_argument("--attn", default="auto", help="model.attn_impl (auto | sdpa | torch_varlen | flash_attention_2)")
    p.add_argument("--kernels", default="auto", help="model.kernels (auto | liger | none)")
    p.add_argument("--full-head", action="store_true",
                   help="score every position through the log-prob head (the code before the response-only head)")
    p.add_argument("--workdir", default="/tmp/ds_rlhf_rlbench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p


def time_budget(actor, traj, cfg, budget: int, repeats: int, gen, sync, step_times: list | None) -> dict:
    """`policy_update` at micro-batch token budget `budget`: one warm-up, then `repeats` synchronised timings (and,
    with `step_times`, the optimizer step's own seconds)."""
    from ds_rlhf.recipes.policy_update import policy_update

    cfg.data.micro_batch_tokens = budget
    policy_update(actor, None, traj, cfg, kl_coef=0.0, generator=gen)  # warm-up
    sync()
    times = []
    if step_times is not None:
        step_times.clear()
    for _ in range(repeats):
        t0 = time.perf_counter()
        policy_update(actor, None, traj, cfg, kl_coef=0.0, generator=gen)
        sync()
        times.append(time.perf_counter() - t0)
    out = {"seconds": times}
    if step_times is not None:
        out["optimizer_step_seconds"] = min(step_times) if step_times else None  # one step per update here
    return out


def main() -> None:
    args = build_parser().parse_args()

    import torch

    from ds_rlhf.config import parse_config
    from ds_rlhf.engines.builder import build_actor
    from ds_rlhf.recipes.rl_build import resolve_shared_prompt
    from ds_rlhf.run.context import setup_run

    _patch_head(args.head_backward, args.head_chunk, args.head_eager)
    full_head(args.full_head)
    workdir = Path(args.workdir)
    model = build_model(workdir, args.tiny, args.model)
    budgets = [int(x) for x in args.micro_batch_tokens.split(",")]
    cfg = parse_config(["--model.path", str(model), "--run.output_dir", tempfile.mkdtemp(), "--ds_config",
                        args.ds_config, "--model.gradient_checkpointing", str(args.grad_ckpt), "--run.tensorboard",
                        "false", "--rollout.max_new_tokens", str(args.response_len), "--data.rl_packing",
                        str(args.packing), "--data.micro_batch_tokens", str(budgets[0]), "--model.attn_impl",
                        args.attn, "--model.kernels", args.kernels, "--data.rl_shared_prompt", args.shared_prompt,
                        "--rollout.n_samples", "8", "--data.max_prompt_len", str(args.prompt_len)])
    ctx = setup_run(cfg, "train-bench")
    actor = build_actor(ctx.model_path, ctx.ds_config(role="actor", micro_batch_size=4, lr=1e-6, total_steps=1000),
                        attn_impl=cfg.model.attn_impl, gradient_checkpointing=args.grad_ckpt,
                        kernels=cfg.model.kernels)
    resolve_shared_prompt(ctx, actor)  # on | off for this actor, printed
    traj = synthetic_trajectory(cfg, args.samples, args.prompt_len, args.response_len, 400, ctx.dist.device)
    tokens = float(traj.seq_lens.sum())
    groups = -(-args.samples // 8)  # the shared-prompt layout: each group's prompt once (a group per micro-batch)
    forwarded = tokens - (args.samples - groups) * args.prompt_len if cfg.data.rl_shared_prompt == "on" else tokens
    n_params = train_mfu_params(model)
    from ds_rlhf.engines.models import unwrap

    attn = unwrap(actor, peft=True).config._attn_implementation
    kernels = kernels_used(actor)
    print(f"[train_step_gpu] attention {attn}, packing {args.packing}, kernels {kernels}, full head "
          f"{args.full_head}", flush=True)
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step_times = _time_optimizer_steps(actor, sync) if args.breakdown else None
    results = []
    for budget in budgets:
        timed = time_budget(actor, traj, cfg, budget, args.repeats, gen, sync, step_times)
        best = min(timed["seconds"])
        row = {"micro_batch_tokens": budget, "packing": args.packing, "attn": attn, "kernels": kernels,
               "shared_prompt": cfg.data.rl_shared_prompt,
               "full_head": args.full_head, "seconds": timed["seconds"],
               "tokens": tokens, "forwarded_tokens": forwarded, "tokens_per_s": tokens / best,
               "mfu": 6 * n_params * tokens / best / (PEAK_TFLOPS * 1e12),
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
        if "optimizer_step_seconds" in timed:
            row["optimizer_step_seconds"] = timed["optimizer_step_seconds"]
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.profile:
        profile_update(actor, traj, cfg, gen)
    write_results(args, attn, kernels, n_params, results)


def profile_update(actor, traj, cfg, gen) -> None:
    """`--profile`: one policy update under the torch profiler, its top CUDA kernels printed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ds_rlhf.recipes.policy_update import policy_update

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        policy_update(actor, None, traj, cfg, kl_coef=0.0, generator=gen)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def write_results(args, attn: str, kernels: str, n_params: int, results: list[dict]) -> None:
    """`train_step_<tag>.json` into `--out`, the tag naming the shape and the switches."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"{args.model}-{args.head_backward}-chunk{args.head_chunk or 'default'}{'-eager' if args.head_eager else ''}"
           f"{'-packed' if args.packing else ''}-{attn}-{kernels}{'-fullhead' if args.full_head else ''}"
           f"{'-sharedprompt' if args.shared_prompt == 'on' else '-rows' if args.shared_prompt == 'off' else ''}")
    (out / f"train_step_{tag}.json").write_text(json.dumps({"config": vars(args), "params": n_params,
                                                                   "results": results}, indent=1))


if __name__ == "__main__":
    main()
