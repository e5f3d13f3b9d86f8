"""Several plain vLLM engines on one GPU: does splitting the rollout batch over N engine processes raise tokens/s?

vLLM's decode at the rollout batch is bound by its per-step host work (scheduler, sampler bookkeeping, output
processing: Python loops over the running requests), not by the GPU (NVML ~30-40%, `vllm_plain_gpu.py`). Host work
per step grows with the requests in the step, and one engine's host work runs on one Python thread; N engine
processes each with 1/N of the batch run N of those loops at once on other cores while they share the GPU.

All `--max-engines` engines start once, one after the other (each `gpu_memory_utilization` = `--gpu-mem` / that
count, so the memory split is explicit, and the same whatever N is timed: at the default batch one engine's share
still holds every sequence's KV cache), in their own processes; then for each N in `--engines` the batch (the
prompts of `bench/rl_step_gpu.py`'s rollout: 32 prompts x 8 samples, 128-token prompts, 256 new tokens, per-token
log-probs) is split into N contiguous prompt shards, engines 0..N-1 start their shard at the same wall-clock time,
and the round's time is from that start to the last engine's end. NVML is sampled every 100 ms. Engine options are
those of the rollout engine (`ds_rlhf.rollout.vllm_adapter.engine_option_kwargs`, processed log-probs); no seeds
per request (the default `rollout.seeding=batch` sends none).

    python3 bench/vllm_engines_gpu.py --out $OUT                      # N = 1, 2, 4 (4 engines started)
    python3 bench/vllm_engines_gpu.py --engines 1,2,3 --max-engines 3 --out $OUT
    python3 bench/vllm_engines_gpu.py --tiny --engines 1,2 --max-engines 2 --out /tmp/x   # CPU logic check

Writes $OUT/vllm_engines_<tag>.json: per N the rounds (seconds, tokens, tokens/s), the median, and NVML mean over
the timed rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core, as our engines run it


def parse_args(argv=None) -> argparse.Namespace:
    from vllm_plain_gpu import parse_args as plain_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="1,2,4", help="comma list of engine counts to time")
    p.add_argument("--max-engines", type=int, default=0, help="engines started (default: the largest count)")
    p.add_argument("--seeds", action="store_true", help="per-request seeds (rollout.seeding=request)")
    known, rest = p.parse_known_args(argv)
    args = plain_args(rest + ([] if known.seeds else ["--no-seeds"]))  # model, batch, lengths, engine options
    args.engine_counts = sorted({int(n) for n in known.engines.split(",") if n.strip()})
    args.max_engines = known.max_engines or max(args.engine_counts)
    if not args.engine_counts or min(args.engine_counts) < 1 or max(args.engine_counts) > args.max_engines:
        p.error(f"--engines {known.engines!r}: counts must be >= 1 and <= --max-engines {args.max_engines}")
    if args.prompts < max(args.engine_counts):
        p.error(f"--prompts {args.prompts} is fewer than {max(args.engine_counts)} engines")
    return args


def worker(index: int, args, model_dir: str, conn) -> None:
    """One engine process: build the LLM, say ready, then generate each shard it is sent at the given start time."""
    from vllm import LLM
    from vllm_plain_gpu import llm_kwargs, sampling_params

    from ds_rlhf.rollout.vllm_adapter import is_cpu_platform, vllm_version

    args.gpu_mem = args.gpu_mem / args.max_engines
    kw = llm_kwargs(args, model_dir, cpu=is_cpu_platform(), version=vllm_version())
    kw["gpu_memory_utilization"] = args.gpu_mem  # on CPU: the share of host memory (vLLM's default would take 92%)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    conn.send(("ready", index, time.perf_counter() - t0))
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            break
        _, prompts, start_at = msg
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        params = sampling_params(args, len(prompts))
        if start_at is None:  # warm-up
            llm.generate(inputs[:4], params[:4], use_tqdm=False)
            conn.send(("done", index, 0.0, 0.0, 0))
            continue
        time.sleep(max(0.0, start_at - time.time()))
        begin = time.time()
        outs = llm.generate(inputs, params, use_tqdm=False)
        conn.send(("done", index, begin, time.time(), sum(len(c.token_ids) for o in outs for c in o.outputs)))


def start_engines(args, model_dir: Path) -> tuple[list, list]:
    """`args.max_engines` worker processes, started one after the other (vLLM profiles free memory at start-up)."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for i in range(args.max_engines):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(i, args, str(model_dir), child), daemon=True)
        proc.start()
        deadline = time.monotonic() + 900
        while not parent.poll(1.0):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine {i} did not start (exit code {proc.exitcode}; its log is above)")
        status, _, seconds = parent.recv()
        print(f"engine {i} ready in {seconds:.1f} s", flush=True)
        procs.append(proc)
        conns.append(parent)
    return procs, conns


def time_rounds(conns: list, prompts: list, n: int, repeats: int) -> list[dict]:
    """`repeats` rounds of the whole batch split over engines 0..n-1 (plus one untimed warm-up on each)."""
    from ds_rlhf.rollout.server.sharded import shard_bounds

    bounds = shard_bounds(len(prompts), n)  # the shards rollout.sidecar_engines cuts
    for c in conns[:n]:
        c.send(("gen", prompts[:4], None))
    for c in conns[:n]:
        c.recv()
    rounds = []
    for _ in range(repeats):
        start_at = time.time() + 0.3
        for i, c in enumerate(conns[:n]):
            c.send(("gen", prompts[bounds[i][0]:bounds[i][1]], start_at))
        done = [c.recv() for c in conns[:n]]
        begin, end = min(d[2] for d in done), max(d[3] for d in done)
        tokens = sum(d[4] for d in done)
        rounds.append({"start": begin, "end": end, "seconds": end - begin, "tokens": tokens,
                       "tokens_per_s": tokens / (end - begin), "per_engine_seconds": [d[3] - d[2] for d in done]})
    return rounds


def main(argv=None) -> dict:
    args = parse_args(argv)
    from bench_inputs import build_model
    from gpu_timeline import Sampler, summarize
    from vllm_plain_gpu import load_prompts

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(workdir, args.tiny, args.model)
    prompts = load_prompts(args, model_dir)
    procs, conns = start_engines(args, model_dir)
    result = {"tag": args.tag or f"{'tiny' if args.tiny else args.model}-max{args.max_engines}",
              "config": {k: v for k, v in vars(args).items()}, "per_engines": {}}
    try:
        with Sampler(0.1) as sampler:
            for n in args.engine_counts:
                rounds = time_rounds(conns, prompts, n, args.repeats)
                util = [summarize(sampler.samples, [], (r["start"], r["end"]))["gpu_util_mean"] for r in rounds]
                tps = [r["tokens_per_s"] for r in rounds]
                result["per_engines"][n] = {"rounds": rounds, "tokens_per_s_median": statistics.median(tps),
                                            "seconds_median": statistics.median(r["seconds"] for r in rounds),
                                            "gpu_util_mean_per_round": util, "nvml_source": sampler.source}
                print(f"{n} engine(s): {statistics.median(tps):,.0f} tokens/s median, rounds "
                      f"{[round(r['seconds'], 3) for r in rounds]} s, NVML {util}", flush=True)
    finally:
        for c in conns:
            c.send(("close",))
        for p in procs:
            p.join(timeout=60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vllm_engines_{result['tag']}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
