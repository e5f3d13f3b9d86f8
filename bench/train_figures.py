"""The training phase's figures in the GPU benchmarks: MFU (6*N FLOPs per trained token over the bf16 matmul
peak) and the kernels the actor runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def kernels_used(actor) -> str:
    """"liger" when the actor's final RMSNorm runs liger's kernel (model.kernels as resolved here), else "none"."""
    from ds_rlhf.engines.models import unwrap

    norm = unwrap(actor, peft=True).get_decoder().norm
    return "liger" if "liger" in type(norm).__module__ + getattr(norm.forward, "__module__", "") else "none"


def train_mfu_params(model_dir: Path) -> int:
    """N for 6*N FLOPs per token: every weight matrix, the (tied) embedding / head once."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, i, layers, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return layers * per_layer + v * h * (1 if c.tie_word_embeddings else 2)


def train_mfu(steady: list[dict], model_dir: Path, unforwarded_tokens: int = 0, peak_tflops: float = 790.0) -> dict:
    """Training-phase MFU: 6 N FLOPs per trained token over the measured bf16 matmul peak of the H200
    (790 TFLOP/s, measured with a bf16 matmul on the H200), prompt and response tokens counted. With the
    shared-prompt layout (`data.rl_shared_prompt`) `unforwarded_tokens` prompt tokens per step are not forwarded
    (a group's prompt goes through the model once, not once per sample): `mfu_forwarded` counts the tokens forwarded
    only, `mfu` all of them (the work a padded-rows run does for the step)."""
    n = train_mfu_params(model_dir)
    tokens = statistics.median(h_["throughput/tokens_per_s"] * h_["time/wall"] for h_ in steady)
    train_s = statistics.median(h_.get("time/train", 0.0) for h_ in steady)
    flops = 6 * n * tokens
    out = {"params": n, "tokens_per_step": tokens, "train_seconds": train_s,
           "train_tflops": flops / train_s / 1e12 if train_s else None,
           "mfu": flops / train_s / (peak_tflops * 1e12) if train_s else None,
           "note": "6*N per trained token (prompt and response), whatever the head skips"}
    if unforwarded_tokens:
        forwarded = tokens - unforwarded_tokens
        out["forwarded_tokens_per_step"] = forwarded
        out["mfu_forwarded"] = 6 * n * forwarded / train_s / (peak_tflops * 1e12) if train_s else None
    return out


def unforwarded_prompts(args, cfg) -> int:
    """Prompt tokens per step the shared-prompt layout does not forward: each prompt (exactly --prompt-len tokens)
    once per micro-batch instead of once per sample; 0 with the layout off. Assumes each group in one micro-batch
    (`group_micro_batches` splits a group only when it alone is over the token budget)."""
    if cfg.data.rl_shared_prompt != "on":
        return 0
    return args.prompts * (args.samples - 1) * args.prompt_len
