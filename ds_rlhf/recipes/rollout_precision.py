"""The rollout engines' precision at run start: refused where the engine cannot run it, and named in one line where
the trainer computes in float32 and the engines in bf16 / fp16 (`rollout.dtype`, `RolloutConfig.engine_precision`)."""

from __future__ import annotations

from ds_rlhf.config import Config, fp8_fp32_refusal
from ds_rlhf.errors import ConfigError
from ds_rlhf.rollout.factory import resolve_backend
from ds_rlhf.run.context import RunContext


def check_rollout_precision(cfg: Config, ctx: RunContext) -> None:
    """The rollout engines' precision (`RolloutConfig.engine_precision`: rollout.dtype, auto = the trainer's) where
    the engine cannot run it, refused before any model is built (vLLM would refuse it only after the actor is loaded
    and the engine has started): vLLM on CPU syncs weights only in float32; on GPUs vLLM's FP8 quantizes bf16/fp16
    weights only (on CPU the engine refuses FP8 itself). The HF backend loads its own copy in any precision."""
    engine = cfg.rollout.engine_precision(ctx.precision)
    if resolve_backend(cfg.rollout.backend) != "vllm":
        return
    where = (f"rollout.dtype={cfg.rollout.dtype}" if cfg.rollout.dtype != "auto" else
             f"model.dtype={cfg.model.dtype} ({ctx.precision}, the rollout's too with rollout.dtype auto)")
    if ctx.dist.device.type == "cpu":
        if engine == "fp32":
            return
        raise ConfigError(f"{where} with the vLLM rollout on CPU: vLLM's CPU backend takes weight syncs only in "
                          "float32; use --rollout.dtype fp32 (the trainer keeps model.dtype), or --rollout.backend hf")
    if cfg.rollout.quantization != "none" and engine == "fp32":
        raise ConfigError(fp8_fp32_refusal(f"{where} with rollout.quantization={cfg.rollout.quantization}"))


def mixed_precision_note(cfg: Config, ctx: RunContext) -> str | None:
    """One line where the trainer computes in float32 and the rollout engines in bf16 / fp16: the engines hold the
    weights rounded, so updates under half a bf16 step reach the trainer's forward but not the rollouts until they add
    up, and the samples come from a policy other than the trainer's (`docs/PERFORMANCE.md`, mixed precision)."""
    engine = cfg.rollout.engine_precision(ctx.precision)
    if ctx.precision != "fp32" or engine not in ("bf16", "fp16"):
        return None
    correction = ("the mismatch correction (rl.mismatch off) is off: nothing weights it" if cfg.rl.mismatch == "off"
                  else f"rl.mismatch {cfg.rl.mismatch} weights the samples")
    return (f"[rl] model.dtype fp32 with {engine} rollout engines: Adam steps under half a {engine} step move the "
            f"trainer's float32 forward but not the engines' rounded weights, so the rollouts trail the trainer "
            f"({correction}; SmolLM2-135M at lr 2e-5 on an H200: rollout/trainer KL 0.0008 -> 0.078 in 13 steps, "
            f"steady 0.002 with bf16 on both sides). --model.dtype bf16 keeps float32 master weights in the optimizer "
            f"and both sides on the same rounded weights")
