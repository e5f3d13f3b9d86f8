"""Load DeepSpeed JSON configs and resolve their ``"auto"`` values from the run's settings.

Raw DeepSpeed rejects ``"auto"``; Hugging Face's Trainer/accelerate fill those values from the command line before
handing the config over. We do the same, with one rule for everything: ``"auto"`` (or a missing key) takes the CLI
value; an explicit value in the file wins over a setting left at its default (logged as a warning; a setting the
user gave that differs from it is refused when the config is parsed, `config_precedence.py`) unless the combination
is one DeepSpeed would reject, in which case we raise a ``ConfigError`` (a ValueError) naming the key. After
resolution no ``"auto"`` may remain.

The resolved dict is what gets passed to ``deepspeed.initialize``, logged, and saved beside every checkpoint, so a
run can be reproduced from the checkpoint alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from ds_rlhf.ds_config_file import load_ds_config
from ds_rlhf.errors import ConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
PRECISIONS = ("fp32", "bf16", "fp16")
RESOLVED_NAME = "ds_config.resolved.json"
# DeepSpeed's own defaults, used for bucket sizes when the model's hidden size is not known.
DS_BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                       "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000}


def pick_precision(requested: str = "auto") -> str:
    """bf16 where the GPU supports it, else fp16 (with dynamic loss scaling); fp32 on CPU unless bf16 is asked for.

    CPU defaults to fp32 because DeepSpeed's CPU accelerator has no fp16 and bf16 matmuls are slow or emulated on
    many CPUs; tests also rely on fp32 for exact cross-stage comparisons.
    """
    import torch
    from deepspeed.accelerator import get_accelerator

    on_gpu = get_accelerator().device_name() == "cuda" and torch.cuda.is_available()
    if requested == AUTO:
        if not on_gpu:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if requested not in PRECISIONS:
        raise ConfigError(f"model.dtype={requested!r}: choose one of auto, {', '.join(PRECISIONS)}")
    if requested == "fp16" and not on_gpu:
        raise ConfigError("model.dtype=fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 support; use "
                          "--model.dtype fp32 (or bf16, or auto)")
    if requested == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError("model.dtype=bf16: this GPU does not support bf16; use --model.dtype fp16 (or auto)")
    return requested


OVERRIDES: list[tuple[str, Any, Any]] = []  # (key, file value, run value) of the last resolve_ds_config call


def _fill(section: dict, key: str, value: Any, where: str) -> None:
    """Set ``section[key]`` if it is auto/missing; otherwise keep the file's value and warn when it differs."""
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif value is not None and current != value:
        OVERRIDES.append((where, current, value))
        logger.warning("ds_config %s=%r (from the file) overrides the run's default %r", where, current, value)


# Top-level keys DeepSpeed reads: its constants modules (collected at first use) plus sections named elsewhere.
_EXTRA_KEYS = {"progressive_layer_drop", "quantize_training", "compression_training", "nebula", "elasticity",
               "sequence_parallel_size", "graph_harvesting", "compile", "timers", "expert_parallel_size",
               "weight_quantization", "hybrid_engine", "tensorboard", "wandb", "csv_monitor", "comet"}
_CONSTANT_MODULES = ("deepspeed.runtime.constants", "deepspeed.runtime.zero.constants", "deepspeed.runtime.zero.config",
                     "deepspeed.runtime.activation_checkpointing.config", "deepspeed.profiling.constants",
                     "deepspeed.monitor.config", "deepspeed.autotuning.constants", "deepspeed.elasticity.constants",
                     "deepspeed.compression.constants", "deepspeed.runtime.data_pipeline.constants",
                     "deepspeed.comm.constants", "deepspeed.runtime.swap_tensor.constants",
                     "deepspeed.nebula.constants", "deepspeed.checkpoint.constants", "deepspeed.runtime.config")


def known_top_level_keys() -> set[str]:
    import importlib

    keys = set(_EXTRA_KEYS)
    for name in _CONSTANT_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module another DeepSpeed version lacks: its keys are just not known
            continue
        keys.update(v for k, v in vars(module).items()
                    if k.isupper() and isinstance(v, str) and v.islower() and v.replace("_", "").isalnum())
    return keys


def check_top_level_keys(raw: dict, where: str) -> list[str]:
    """Unknown top-level keys (DeepSpeed ignores them silently). One that is a near-miss of a known key is an error
    naming both (a typo would otherwise be ignored); others are returned, for the caller to warn about. Nested
    sections such as zero_optimization are validated by DeepSpeed itself (its pydantic models forbid extras)."""
    import difflib

    known = known_top_level_keys()
    unknown = [k for k in raw if k not in known]
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if close:
            raise ConfigError(f"{where}: unknown DeepSpeed key {key!r} (did you mean {close[0]!r}?); DeepSpeed would "
                             "ignore it silently")
    return unknown


def _resolve_batch(cfg: dict, micro_batch_size: int, grad_accum: int, world_size: int) -> None:
    _fill(cfg, "train_micro_batch_size_per_gpu", micro_batch_size, "train_micro_batch_size_per_gpu")
    _fill(cfg, "gradient_accumulation_steps", grad_accum, "gradient_accumulation_steps")
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    expected = mbs * gas * world_size
    if cfg.get("train_batch_size", AUTO) == AUTO:
        cfg["train_batch_size"] = expected
    elif cfg["train_batch_size"] != expected:
        raise ConfigError(f"ds_config key 'train_batch_size'={cfg['train_batch_size']} != "
                          f"train_micro_batch_size_per_gpu ({mbs}) * gradient_accumulation_steps ({gas}) * "
                          f"world_size ({world_size}) = {expected}; DeepSpeed rejects this. Set it to 'auto' or fix "
                          "the batch settings.")


def _resolve_precision(cfg: dict, precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    for key, want in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        section = cfg.setdefault(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"ds_config key '{key}' must be an object like {{\"enabled\": true}}")
        _fill(section, "enabled", want, f"{key}.enabled")
    if cfg["bf16"]["enabled"] and cfg["fp16"]["enabled"]:
        raise ConfigError("ds_config keys 'bf16.enabled' and 'fp16.enabled' are both true; DeepSpeed rejects this")


def _resolve_optimizer(cfg: dict, lr, weight_decay, betas, eps, warmup_steps, total_steps) -> None:
    opt = cfg.get("optimizer")
    if opt:
        params = opt.setdefault("params", {})
        for key, value in (("lr", lr), ("weight_decay", weight_decay), ("betas", list(betas)), ("eps", eps)):
            _fill(params, key, value, f"optimizer.params.{key}")
        if opt.get("type") == "OneBitAdam" and params.get("freeze_step", AUTO) == AUTO:
            # Tang et al. warm up for ~15-25% of training; we take 15%, and never less than the LR warm-up.
            if total_steps is None:
                raise ConfigError("ds_config key 'optimizer.params.freeze_step' is 'auto' but total_steps was not "
                                 "given; pass total_steps or set freeze_step explicitly")
            params["freeze_step"] = max(int(warmup_steps), math.ceil(0.15 * total_steps), 1)
    sched = cfg.get("scheduler")
    if sched:
        params = sched.setdefault("params", {})
        if (params.get("warmup_num_steps") == AUTO and warmup_steps == 0 and sched.get("type") == "WarmupLR"):
            # DeepSpeed's WarmupLR rejects 0 warm-up steps; no warm-up means a constant LR, i.e. no scheduler.
            logger.info("warmup_steps=0: dropping the WarmupLR scheduler (constant learning rate)")
            del cfg["scheduler"]
            return
        values = {"warmup_max_lr": lr, "warmup_min_lr": 0.0, "warmup_num_steps": warmup_steps,
                  "total_num_steps": total_steps}
        for key, value in values.items():
            if params.get(key) == AUTO:
                if value is None:
                    raise ConfigError(f"ds_config key 'scheduler.params.{key}' is 'auto' but the CLI value is missing")
                params[key] = value


def _offload_section(zero: dict, key: str, offload: bool | None, allowed: bool) -> None:
    """``offload_optimizer``/``offload_param``: device "auto" (or no section) follows ``offload`` where allowed."""
    section = zero.get(key)
    if section is not None and section != AUTO and not isinstance(section, dict):
        raise ConfigError(f"ds_config key 'zero_optimization.{key}' must be an object like {{\"device\": \"cpu\"}}")
    device = section.get("device", AUTO) if isinstance(section, dict) else AUTO
    if device == AUTO:
        want = "cpu" if (offload and allowed) else "none"
        if want == "none" and not isinstance(section, dict):
            zero.pop(key, None)
            return
        zero[key] = {**(section if isinstance(section, dict) else {}), "device": want}
        if want == "cpu":
            zero[key].setdefault("pin_memory", True)
    elif offload is not None and (device != "none") != bool(offload and allowed):
        logger.warning("ds_config zero_optimization.%s.device=%r (from the file) overrides offload=%s",
                       key, device, offload)


def _resolve_zero(cfg: dict, zero_stage, offload, hidden_size, world_size) -> None:
    zero = cfg.setdefault("zero_optimization", {})
    if zero_stage is not None and zero.get("stage", AUTO) not in (AUTO, zero_stage):
        # An explicit --zero_stage (or accelerate's DeepSpeed plugin) is a deliberate override of the file.
        logger.warning("zero_stage=%s overrides ds_config zero_optimization.stage=%s", zero_stage, zero["stage"])
        zero["stage"] = zero_stage
    _fill(zero, "stage", zero_stage, "zero_optimization.stage")
    stage = zero["stage"]
    if stage == AUTO or stage is None:
        raise ConfigError("ds_config key 'zero_optimization.stage' is 'auto' and no zero_stage was given")
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config key 'zero_optimization.stage' must be 0-3, got {stage!r}")
    if offload and stage == 0:
        raise ConfigError("offload=True needs ZeRO stage >= 1 (ds_config key 'zero_optimization.stage' is 0); "
                         "DeepSpeed only offloads ZeRO-partitioned state")
    _offload_section(zero, "offload_optimizer", offload, allowed=stage >= 1)
    _offload_section(zero, "offload_param", offload, allowed=stage == 3)
    if zero.get("offload_param", {}).get("device", "none") != "none" and stage != 3:
        raise ConfigError("ds_config key 'zero_optimization.offload_param' needs ZeRO stage 3 (parameters are only "
                         f"partitioned at stage 3), but stage is {stage}")
    sizes = dict(DS_BUCKET_DEFAULTS)
    if hidden_size:  # the same heuristics as transformers' HfTrainerDeepSpeedConfig
        sizes.update(reduce_bucket_size=hidden_size * hidden_size,
                     stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
                     stage3_param_persistence_threshold=10 * hidden_size)
    for key, value in sizes.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    if zero.get("zero_hpz_partition_size") == AUTO:
        # hpZ keeps a secondary weight copy per node; it only pays off when training spans several nodes.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world_size)))
        zero["zero_hpz_partition_size"] = local if world_size > local else 1


def check_optimizer_compat(cfg: dict) -> None:
    """OneBitAdam only runs without ZeRO partitioning; say why instead of failing somewhere deep in DeepSpeed."""
    opt = cfg.get("optimizer") or {}
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if opt.get("type") == "OneBitAdam" and stage != 0:
        raise ConfigError(
            f"optimizer OneBitAdam needs ZeRO stage 0 (ds_config key 'zero_optimization.stage' is {stage}). "
            "1-bit Adam replaces the gradient all-reduce with an error-compensated compressed all-reduce of the "
            "full momentum, which every rank must hold; ZeRO-1/2/3 partition the optimizer states (and stage 2/3 "
            "the gradients) across ranks and reduce-scatter gradients inside DeepSpeed's ZeRO optimizer, so there "
            "is no full momentum to compress and no gradient all-reduce to replace.")


def find_auto(obj: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value still equal to "auto"."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in find_auto(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in find_auto(v, f"{prefix}[{i}]")]
    return [prefix] if obj == AUTO else []


def resolve_ds_config(cfg: dict, *, micro_batch_size: int, grad_accum: int, world_size: int, precision: str,
                      grad_clip: float, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                      warmup_steps: int = 0, total_steps: int | None = None, zero_stage: int | None = None,
                      offload: bool | None = None, hidden_size: int | None = None) -> dict:
    """Return a copy of ``cfg`` with every ``"auto"`` filled; raise ``ConfigError`` naming the key on conflicts.

    ``hidden_size`` (optional) sizes the ZeRO buckets as Hugging Face does; without it DeepSpeed's defaults are used.
    Explicit file values that differ from the run's settings are kept and listed in ``OVERRIDES``.
    """
    OVERRIDES.clear()
    cfg = load_ds_config(cfg)
    if precision == AUTO:
        precision = pick_precision()
    _resolve_batch(cfg, micro_batch_size, grad_accum, world_size)
    _fill(cfg, "gradient_clipping", float(grad_clip), "gradient_clipping")
    _resolve_precision(cfg, precision)
    _resolve_optimizer(cfg, lr, weight_decay, betas, eps, warmup_steps, total_steps)
    _resolve_zero(cfg, zero_stage, offload, hidden_size, world_size)
    check_optimizer_compat(cfg)
    if (cfg.get("optimizer") or {}).get("type") == "OneBitAdam" and offload:
        raise ConfigError("optimizer OneBitAdam cannot be combined with offload=True (offload needs ZeRO >= 1)")
    left = find_auto(cfg)
    if left:
        raise ConfigError(f"ds_config still has 'auto' values after resolution: {', '.join(left)}")
    log_resolved_config(cfg)
    return cfg


def config_precision(cfg: dict) -> str:
    """"bf16", "fp16" or "fp32" as enabled in a resolved config."""
    if cfg.get("bf16", {}).get("enabled") is True:
        return "bf16"
    if cfg.get("fp16", {}).get("enabled") is True:
        return "fp16"
    return "fp32"


def log_resolved_config(cfg: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.info("resolved ds_config:\n%s", json.dumps(cfg, indent=2, sort_keys=True))


def save_resolved_config(cfg: dict, out_dir: str | os.PathLike) -> Path:
    """Write ``ds_config.resolved.json`` into ``out_dir`` (created if needed); return its path."""
    left = find_auto(cfg)
    if left:
        raise ValueError(f"refusing to save an unresolved ds_config ('auto' at {', '.join(left)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESOLVED_NAME
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path
