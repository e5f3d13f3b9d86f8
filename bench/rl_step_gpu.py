"""RL step benchmark on one GPU: GRPO with the vLLM sidecar colocated, through `launch/train_ppo.py`'s trainer.

The default setup is the brief's TRL comparison: a Qwen2-0.5B-shaped model (vocab 151936, random init, bf16),
32 prompts x 8 samples x 256 new tokens, 128-token prompts, no KL (beta 0), one PPO epoch. The tokenizer is the
offline tiny one (ids < 512); the model's vocabulary is the full 151936, so sampling and the log-prob head cost
what they cost on the real model. Rewards come from a cheap deterministic rule (`bench/bench_rewards.py`), so the
advantages are not all zero. Reports per-phase medians over the steps after warm-up and completions/s.

    python3 bench/rl_step_gpu.py --steps 22 --out $OUT [--sleep] [--micro-batch-tokens 16384]
    python3 bench/rl_step_gpu.py --tiny --steps 3          # CPU logic check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]

QWEN2_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096)


def build_model(workdir: Path, tiny: bool) -> Path:
    """Random-init Qwen2 (0.5B shape, or the tiny one) saved with the offline tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from ds_rlhf.engines.tiny_models import build_tiny_model

    tiny_dir = build_tiny_model()
    if tiny:
        return tiny_dir
    out = workdir / "qwen2-0.5b-shape"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = Qwen2Config(**QWEN2_05B, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_prompts(workdir: Path, model_dir: Path, n: int, prompt_len: int) -> Path:
    """`n` prompts of exactly `prompt_len` tokens: chat header + random token ids + generation prompt."""
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(model_dir)
    head = tok.apply_chat_template([{"role": "user", "content": "X"}], add_generation_prompt=True, return_dict=False)
    x = head.index(tok.convert_tokens_to_ids("X")) if "X" in tok.get_vocab() else len(head) // 2
    prefix, suffix = head[:x], head[x + 1 :]
    body = prompt_len - len(prefix) - len(suffix)
    rng = random.Random(0)
    rows = [{"input_ids": prefix + [rng.randrange(10, 400) for _ in range(body)] + suffix, "prompt_text": "",
             "ground_truth": None, "data_source": "bench", "extra": None, "row_id": i, "source_idx": 0}
            for i in range(n)]
    out = workdir / f"prompts-{prompt_len}"
    return write_store(out, "prompts", rows, tokenizer_name=str(model_dir),
                       tokenizer_fingerprint=tokenizer_fingerprint(tok))


def summarize(history: list[dict], skip: int, completions: int) -> dict:
    steady = history[skip:] or history
    keys = sorted({k for h in steady for k in h if k.startswith(("time/", "sync/", "throughput/", "sys/"))})
    med = {k: statistics.median(h[k] for h in steady if k in h) for k in keys}
    wall = med.get("time/wall", med.get("time/step"))
    return {"steps": len(history), "steady_steps": len(steady), "median": med,
            "completions_per_s": completions / wall if wall else None,
            "reward_first": history[0].get("reward/mean"), "reward_last": history[-1].get("reward/mean")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=22)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--sleep", action="store_true", help="vLLM sleep mode between rollouts (as TRL's bar ran)")
    p.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--ds-config", default="ds_configs/zero2.json")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU logic check with the tiny model")
    p.add_argument("--workdir", default="/tmp/ds_rlhf_rlbench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from ds_rlhf.config import parse_config
    from ds_rlhf.trainer.rl_trainer import RLTrainer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(workdir, args.tiny)
    prompts = build_prompts(workdir, model, args.prompts * (args.steps + 1), args.prompt_len)
    print(f"[rl_step_gpu] model {model}, prompts {prompts} ({time.time() - t0:.1f}s)", flush=True)
    tag = args.tag or ("sleep" if args.sleep else "nosleep")
    run_dir = workdir / f"run-{tag}"
    cfg = parse_config([
        "--model.path", str(model), "--data.train", str(prompts), "--run.output_dir", str(run_dir),
        "--run.steps", str(args.steps), "--rl.algo", "grpo", "--rl.kl_coef", "0",
        "--rl.reward_fn", f"{ROOT / 'bench' / 'bench_rewards.py'}:distinct_ratio",
        "--rl.prompts_per_step", str(args.prompts), "--rollout.n_samples", str(args.samples),
        "--rollout.max_new_tokens", str(args.new_tokens), "--rollout.sleep", str(args.sleep),
        "--rollout.gpu_memory_utilization", str(args.gpu_mem), "--data.max_prompt_len", str(args.prompt_len),
        "--data.micro_batch_tokens", str(args.micro_batch_tokens), "--model.gradient_checkpointing",
        str(args.grad_ckpt), "--optim.lr", "1e-6", "--ds_config", args.ds_config, "--run.progress", "false",
        "--run.tensorboard", "false", "--run.export_hf", "false", "--run.keep_last", "1"])
    t1 = time.time()
    trainer = RLTrainer(cfg)
    setup_s = time.time() - t1
    history = trainer.train()
    result = {"tag": tag, "config": vars(args), "setup_seconds": setup_s, "total_seconds": time.time() - t0,
              **summarize(history, args.warmup_steps, args.prompts * args.samples), "history": history}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rl_step_{tag}.json").write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=1, default=float), flush=True)


if __name__ == "__main__":
    main()
