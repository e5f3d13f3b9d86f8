"""Plain vLLM throughput: `vllm.LLM.generate` tokens/s on the rollout shape of `bench/rl_step_gpu.py`, with the
same vLLM engine options, so "our rollout tokens/s >= plain vLLM with the same options" can be checked per option.

Defaults are rl_step_gpu.py's rollout: the Qwen2-0.5B-shaped random-init model it builds (bf16, vocab 151936, the
offline tiny tokenizer; the same directory under --workdir), 32 prompts x 8 samples, 128-token prompts (its prompt
construction), 256 new tokens, `gpu_memory_utilization` 0.35, one in-process engine ("uni" executor), per-request
seeds and per-token log-probs of the sampled tokens, as the rollout engine asks. `--ignore-eos` (default on) makes
every response 256 tokens; the random model almost never emits EOS anyway. The engine options go through
`ds_rlhf.rollout.vllm_adapter.engine_option_kwargs`, the translation and checks every rollout engine uses (so
`logprobs_mode=processed_logprobs` too; `--logprobs-mode raw_logprobs` measures vLLM's default).

    python3 bench/vllm_plain_gpu.py --out $OUT --tag plain_baseline
    python3 bench/vllm_plain_gpu.py --max-num-seqs 256 --out $OUT --tag plain_seqs256
    python3 bench/vllm_plain_gpu.py --async-scheduling true --temperature 0.7 --out $OUT
    python3 bench/vllm_plain_gpu.py --tiny --out /tmp/x          # CPU logic check (tiny model, tiny batch)

Writes $OUT/vllm_plain_<tag>.json: the options asked for, the engine's effective options (what vLLM filled in),
tokens/s of each timed run (after one warm-up), best and median. vLLM is called directly here: it is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core, as our engines run it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", help="rl_step_gpu.py's Qwen2 shape (0.5b | 1.5b)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8, help="responses per prompt (SamplingParams.n)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls after the warm-up")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--no-logprobs", action="store_true", help="do not ask for per-token log-probs")
    p.add_argument("--logprobs-mode", default="", help="override the engine's logprobs_mode (default: ours)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--no-seeds", dest="seeds", action="store_false", help="no per-request seeds")
    # the engine options, as rollout.<name> in the config
    p.add_argument("--async-scheduling", choices=("auto", "true", "false"), default="auto")
    p.add_argument("--max-num-seqs", type=int, default=0, help="0 = vLLM's default")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0 = vLLM's default")
    p.add_argument("--cudagraph-sizes", default="", help="comma list; empty = vLLM's default capture sizes")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="after the timed calls, profile one more: the host functions that take the time (cProfile, "
                        "which slows Python down, so read shares, not seconds) and, on CUDA, the GPU-busy share of "
                        "a further call (torch.profiler kernel time over its wall time)")
    p.add_argument("--tiny", action="store_true", help="CPU logic check: tiny model, 4 prompts x 2, 16 + 16 tokens")
    p.add_argument("--workdir", default="/tmp/ds_rlhf_rlbench", help="shared with rl_step_gpu.py (same model dir)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 4, 2, 16, 16
        args.repeats = min(args.repeats, 1)
    return args


def engine_options(args) -> dict:
    """The engine options as `RolloutConfig.vllm_options()` gives them (only those set away from the default)."""
    from ds_rlhf.config import parse_config

    argv = ["--rollout.async_scheduling", args.async_scheduling, "--rollout.max_num_seqs", str(args.max_num_seqs),
            "--rollout.max_num_batched_tokens", str(args.max_num_batched_tokens),
            "--rollout.cudagraph_sizes", args.cudagraph_sizes, "--rollout.enforce_eager", str(args.enforce_eager)]
    return parse_config(argv).rollout.vllm_options()


def llm_kwargs(args, model_dir: str, *, cpu: bool, version: str) -> dict:
    """`vllm.LLM(...)` keywords: the rollout engine's construction, minus the weight-sync extension."""
    from ds_rlhf.rollout.vllm_adapter import engine_option_kwargs

    kw = dict(model=model_dir, dtype="float32" if cpu else "bfloat16", max_model_len=args.prompt_len + args.new_tokens,
              seed=0, distributed_executor_backend="uni", tensor_parallel_size=1)
    if not cpu:
        kw["gpu_memory_utilization"] = args.gpu_mem
    kw.update(engine_option_kwargs(cpu=cpu, version=version, **engine_options(args)))
    if args.logprobs_mode:
        kw["logprobs_mode"] = args.logprobs_mode
    return kw


def sampling_params(args, n_prompts: int) -> list:
    """One SamplingParams per prompt, as the rollout engine builds them (seeds: prompt i's first sample 1234 + i*n)."""
    from vllm import SamplingParams

    flat = "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())
    out = []
    for i in range(n_prompts):
        kw = dict(n=args.samples, max_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k if args.top_k > 0 else 0, ignore_eos=args.ignore_eos, detokenize=False,
                  seed=1234 + i * args.samples if args.seeds else None)
        if not args.no_logprobs:
            kw["logprobs"] = 0
            if flat:
                kw["flat_logprobs"] = True
        out.append(SamplingParams(**kw))
    return out


def measure(llm, prompts: list[list[int]], params: list, repeats: int) -> dict:
    """One warm-up call on a few prompts, then `repeats` timed calls of all of them: generated tokens/s each."""
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    llm.generate(inputs[:4], params[:4], use_tqdm=False)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        runs.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    tps = [r["tokens_per_s"] for r in runs]
    return {"runs": runs, "tokens_per_s_best": max(tps), "tokens_per_s_median": statistics.median(tps)}


def profile_call(llm, prompts: list[list[int]], params: list, top: int = 25) -> dict:
    """Where one generate call's host time goes, and (CUDA) how much of a call's wall time the GPU computes.

    `host`: the `top` functions by own time under cProfile (file:line(name), calls, own and cumulative seconds) and
    the call's wall time with the profiler on; `gpu` (CUDA only): kernel seconds / wall seconds of another call."""
    import cProfile
    import pstats

    import torch

    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(inputs, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = {"host": {"wall_seconds_profiled": wall, "top_own_time": [
        {"function": f"{Path(path).name}:{line}({name})", "calls": calls, "own_s": own, "cum_s": cum}
        for (path, line, name), (_, calls, own, cum, _) in rows]}}
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as cuda_prof:
            t0 = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernel_us = sum(e.self_device_time_total for e in cuda_prof.key_averages())
        out["gpu"] = {"wall_seconds": wall, "kernel_seconds": kernel_us / 1e6, "busy_share": kernel_us / 1e6 / wall}
    return out


def load_prompts(args, model_dir: Path) -> list[list[int]]:
    """rl_step_gpu.py's prompts: chat header + random token ids + generation prompt, exactly `--prompt-len` each."""
    from bench_inputs import build_prompts

    from ds_rlhf.data.store import open_store

    own = Path(args.workdir) / "vllm_plain"  # rl_step_gpu.py writes more rows to <workdir>/prompts-N; same first rows
    own.mkdir(parents=True, exist_ok=True)
    store = build_prompts(own, model_dir, args.prompts, args.prompt_len)
    return [list(map(int, r["input_ids"])) for r in open_store(store).rows(range(args.prompts))]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bench_inputs import build_model

    from ds_rlhf.rollout.vllm_adapter import check_vllm_version, effective_engine_options, is_cpu_platform, vllm_version

    version = vllm_version()
    check_vllm_version(version)
    cpu = is_cpu_platform()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(workdir, args.tiny, args.model)
    prompts = load_prompts(args, model_dir)
    kw = llm_kwargs(args, str(model_dir), cpu=cpu, version=version)
    from vllm import LLM  # the baseline is plain vLLM by definition

    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    tag = args.tag or "-".join(["tiny" if args.tiny else args.model, f"async_{args.async_scheduling}",
                                f"seqs{args.max_num_seqs}", f"tok{args.max_num_batched_tokens}"])
    result = {"tag": tag, "vllm_version": version, "config": vars(args), "llm_kwargs": kw,
              "effective_options": effective_engine_options(llm), "start_seconds": start_s,
              "prompts": len(prompts), "samples": args.samples, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, **measure(llm, prompts, sampling_params(args, len(prompts)), args.repeats)}
    if args.profile:
        result["profile"] = profile_call(llm, prompts, sampling_params(args, len(prompts)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vllm_plain_{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
