"""Rollout + weight-sync benchmark on one GPU, colocated, in-process (the numbers of docs/PERFORMANCE.md).

For Qwen2 shapes 0.5B and 1.5B (random init, bf16, tied embeddings) it measures, through ds_rlhf's own code path:
- weight sync HF model -> vLLM (bridge + adapter): seconds and GB/s per sync (median of several, per bucket size);
- the sync canary's max abs log-prob difference before and after the sync;
- generate tokens/s through our RolloutEngine vs plain `vllm.LLM.generate` on the same engine and prompts
  (128-token prompts, 256 new tokens, ignore_eos, batch 256), alternating runs; plain vLLM is measured both with the
  same per-token log-probs our engine asks for, and without log-probs;
- vLLM sleep: memory freed and seconds for level 1 and level 2, wake-up seconds (weights, then KV cache), and the
  canary after a sleep -> wake(weights) -> sync -> wake(kv_cache) cycle.
Each shape runs in its own child process (one vLLM engine per process: the sleep-mode allocator is per process,
and the GPU memory is returned between shapes). DeepSpeed is not needed: the bridge takes the plain HF module.

    python3 bench/rollout_gpu.py                 # both shapes; JSON to $OUT/rollout_gpu.json (or --out FILE)
    python3 bench/rollout_gpu.py --shapes 0.5b   # one shape
    python3 bench/rollout_gpu.py --tiny          # CPU logic check with the tiny shape (no sleep, small batches)

Needs vLLM 0.26..0.32 and a GPU (except --tiny). Plain vLLM is called directly here: it is the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960),
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=256),
}


def _log(msg: str) -> None:
    print(f"[rollout_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_models(shape: str, tiny: bool, workdir: Path):
    """HF model (random init) on the device, and a config-only directory vLLM starts from (load_format=dummy)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    cfg = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096,
                      torch_dtype="float32" if tiny else "bfloat16", bos_token_id=0, eos_token_id=1)
    cfg.save_pretrained(workdir)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the fp32 init blocks back before vLLM sizes its KV cache
    return model, cfg


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_shape(shape: str, args) -> dict:
    import random

    from ds_rlhf.rollout import SyncCanary
    from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    tiny = args.tiny
    res: dict = {"shape": shape, **SHAPES[shape]}
    workdir = Path(tempfile.mkdtemp(prefix=f"rollout_gpu_{shape}_"))
    (model, cfg), res["hf_init_seconds"] = timed(lambda: build_models(shape, tiny, workdir))
    n_prompts, prompt_len, new_tokens = (8, 16, 16) if tiny else (args.batch, args.prompt_len, args.new_tokens)
    max_len = max(512, prompt_len + new_tokens + 16)
    _log(f"{shape}: starting vLLM (dummy weights)")
    engine, res["vllm_start_seconds"] = timed(lambda: VLLMRolloutEngine(
        str(workdir), dtype="float32" if tiny else "bfloat16", max_model_len=max_len,
        gpu_memory_utilization=args.gpu_mem, seed=0, enable_sleep=not tiny, load_format="dummy",
        skip_tokenizer_init=True, enforce_eager=tiny or args.eager))
    res["vllm_version"] = engine.handle.version
    rng = random.Random(0)
    probe = [rng.randrange(2, cfg.vocab_size) for _ in range(64)]
    canary = SyncCanary(probe, threshold=args.canary_threshold)

    res.update(bench_sync(shape, args, model, engine, canary))
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(n_prompts)]
    res["generate"] = bench_generate(shape, args, engine, prompts, new_tokens)
    if not tiny:
        res.update(bench_sleep(shape, model, engine, canary, prompts))
    engine.close()
    return res


def bench_sync(shape: str, args, model, engine, canary) -> dict:
    """Weight sync + canary: per bucket size, the median seconds and GB/s of `--syncs` syncs."""
    from ds_rlhf.rollout import WeightSync

    res = {"canary_before_sync": canary.measure(model, engine)["max_abs_diff"], "sync": {}}
    for mb in args.bucket_mb:
        runs = [WeightSync(model, engine, bucket_bytes=mb << 20, canary=canary).sync() for _ in range(args.syncs)]
        res["sync"][f"bucket_{mb}MiB"] = {
            "bytes": runs[0]["bytes"], "buckets": runs[0]["buckets"],
            "seconds_median": statistics.median(r["seconds"] for r in runs),
            "gbps_median": statistics.median(r["gbps"] for r in runs),
            "seconds_all": [r["seconds"] for r in runs], "canary_seconds": runs[-1]["canary_seconds"],
            "canary_after_sync": runs[-1]["canary_max_abs_diff"]}
        _log(f"{shape}: sync bucket {mb} MiB: {res['sync'][f'bucket_{mb}MiB']['gbps_median']:.1f} GB/s")
    res["canary_after_sync"] = canary.history[-1]["max_abs_diff"]
    res["canary_threshold"] = canary.history[-1]["threshold"]
    return res


def bench_generate(shape: str, args, engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Throughput: our engine vs plain vLLM on the same engine and prompts, alternating, the best of `--repeats`."""
    from vllm import SamplingParams  # the baseline is plain vLLM by definition

    from ds_rlhf.rollout import SamplingSpec

    n_prompts = len(prompts)
    spec = SamplingSpec(max_new_tokens=new_tokens, ignore_eos=True, seed=1234)
    llm = engine.handle.llm
    inputs = [{"prompt_token_ids": p} for p in prompts]
    same_work = [engine.handle.sampling_params(spec, spec.request_seed(i), logprobs=0) for i in range(n_prompts)]
    plain_default = SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False)

    def plain(params):
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def ours():
        return sum(len(s.response_ids) for s in engine.generate(prompts, spec))

    engine.generate(prompts[:8], SamplingSpec(max_new_tokens=8, ignore_eos=True))  # warm-up
    llm.generate(inputs[:8], plain_default, use_tqdm=False)
    tps = {"ours": [], "plain_logprobs": [], "plain_no_logprobs": []}
    for _ in range(args.repeats):
        for key, fn in (("plain_logprobs", lambda: plain(same_work)), ("ours", ours),
                        ("plain_no_logprobs", lambda: plain(plain_default))):
            tokens, secs = timed(fn)
            tps[key].append(tokens / secs)
    best = {k: max(v) for k, v in tps.items()}
    _log(f"{shape}: tokens/s {best}")
    return {"prompts": n_prompts, "prompt_len": len(prompts[0]), "new_tokens": new_tokens,
            "tokens_per_s_best": best, "tokens_per_s_all": tps,
            "ratio_ours_vs_plain_logprobs": best["ours"] / best["plain_logprobs"],
            "ratio_ours_vs_plain_no_logprobs": best["ours"] / best["plain_no_logprobs"]}


def bench_sleep(shape: str, model, engine, canary, prompts: list[list[int]]) -> dict:
    """vLLM sleep per level: memory freed, seconds, wake-up seconds, and the canary after wake -> sync -> wake."""
    import torch

    from ds_rlhf.rollout import SamplingSpec, WeightSync

    res = {"sleep": {}}
    for level in (1, 2):
        engine.sleep_level = level
        free0 = torch.cuda.mem_get_info()[0]
        engine.sleep()
        st = engine.stats()
        entry = {"seconds": st["sleep_seconds"], "freed_gb": st["sleep_freed_bytes"] / 1e9,
                 "free_gb_before": free0 / 1e9, "free_gb_asleep": torch.cuda.mem_get_info()[0] / 1e9}
        info = WeightSync(model, engine, canary=canary).sync()  # wake weights -> sync -> wake KV -> canary
        st = engine.stats()
        entry.update(wake_weights_seconds=st.get("wake_weights_seconds"),
                     wake_kv_cache_seconds=st.get("wake_kv_cache_seconds"), sync_seconds=info["seconds"],
                     canary_after_wake_sync=info["canary_max_abs_diff"])
        res["sleep"][f"level{level}"] = entry
        _log(f"{shape}: sleep level {level}: {entry}")
    n = engine.generate(prompts[:8], SamplingSpec(max_new_tokens=8, ignore_eos=True))
    res["generate_after_sleep_ok"] = len(n) == 8
    return res


def run_child(shape: str, args, out_file: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", shape, "--child-out", str(out_file),
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--gpu-mem", str(args.gpu_mem), "--syncs", str(args.syncs), "--repeats", str(args.repeats),
           "--bucket-mb", *[str(b) for b in args.bucket_mb]]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--eager"] if args.eager else []
    cmd += ["--canary-threshold", str(args.canary_threshold)] if args.canary_threshold is not None else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, timeout=args.child_timeout)
    if proc.returncode != 0 or not out_file.exists():
        return {"shape": shape, "error": f"child exited {proc.returncode}", "seconds": time.perf_counter() - t0}
    res = json.loads(out_file.read_text())
    res["child_seconds"] = time.perf_counter() - t0
    return res


def summary(results: dict) -> str:
    rows = ["| shape | sync GB (s, GB/s) | canary before/after | ours / plain+lp / plain tok/s | ratio | "
            "sleep L1 freed GB (s) | wake w / kv s |", "|---|---|---|---|---|---|---|"]
    for shape, r in results.items():
        if "error" in r:
            rows.append(f"| {shape} | {r['error']} |||||")
            continue
        s = next(iter(r["sync"].values()))
        g = r["generate"]["tokens_per_s_best"]
        sl = r.get("sleep", {}).get("level1", {})
        rows.append(
            f"| {shape} | {s['bytes'] / 1e9:.2f} ({s['seconds_median']:.3f}, {s['gbps_median']:.1f}) | "
            f"{r['canary_before_sync']:.3g} / {r['canary_after_sync']:.3g} | {g['ours']:.0f} / "
            f"{g['plain_logprobs']:.0f} / {g['plain_no_logprobs']:.0f} | "
            f"{r['generate']['ratio_ours_vs_plain_logprobs']:.3f} | {sl.get('freed_gb', float('nan')):.1f} "
            f"({sl.get('seconds', float('nan')):.2f}) | {sl.get('wake_weights_seconds')} / "
            f"{sl.get('wake_kv_cache_seconds')} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=["0.5b", "1.5b"])
    p.add_argument("--tiny", action="store_true", help="CPU logic check: tiny shape, float32, no sleep")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/rollout_gpu.json or ./rollout_gpu.json)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gpu-mem", type=float, default=0.45, help="vLLM gpu_memory_utilization")
    p.add_argument("--syncs", type=int, default=5, help="syncs per bucket size (median reported)")
    p.add_argument("--repeats", type=int, default=2, help="alternating generate runs per variant (best reported)")
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[1024, 256])
    p.add_argument("--canary-threshold", type=float, default=None, help="default: by dtype (bf16 0.5)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    p.add_argument("--child-timeout", type=float, default=300)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        res = bench_shape(args.child, args)
        Path(args.child_out).write_text(json.dumps(res, indent=1))
        return
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "rollout_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    results = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in (["tiny"] if args.tiny else args.shapes):
            _log(f"shape {shape}")
            results[shape] = run_child(shape, args, Path(tmp) / f"{shape}.json")
            out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))  # partial results survive
    meta["total_seconds"] = time.perf_counter() - t0
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(summary(results))
    _log(f"wrote {out} ({meta['total_seconds']:.0f} s)")
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
