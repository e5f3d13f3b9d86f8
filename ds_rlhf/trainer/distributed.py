"""Process-group set-up that works the three ways users launch: `deepspeed`, `accelerate launch`, plain `python`.

- `deepspeed` sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_SIZE/MASTER_* and appends `--local_rank=N` (the config schema
  accepts and ignores that key).
- `accelerate launch` sets the same env vars but LOCAL_WORLD_SIZE instead of LOCAL_SIZE, and describes its
  DeepSpeed plugin through ACCELERATE_DEEPSPEED_* variables; those fill in settings the user left at defaults.
- plain `python` sets nothing: we run as a single process on a free local port.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ds_rlhf.config import Config


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def apply_accelerate_env(cfg: Config) -> None:
    """Take DeepSpeed settings from an `accelerate launch` DeepSpeed plugin where the user gave none."""
    default = Config()
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file and config_file != "none" and cfg.ds_config == default.ds_config:
        cfg.ds_config = config_file
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage and cfg.zero_stage == -1:
        cfg.zero_stage = int(stage)
    offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
    if offload == "cpu" and not cfg.offload:
        cfg.offload = True
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if precision in ("bf16", "fp16") and cfg.model.dtype == "auto":
        cfg.model.dtype = precision


def init_distributed(cfg: Config) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPU, gloo on CPU) and pick this rank's device."""
    from datetime import timedelta

    import torch.distributed as dist

    from ds_rlhf.engines.dist import ensure_distributed

    if cfg.local_rank >= 0:  # the `deepspeed` launcher's --local_rank, when its env var is missing
        os.environ.setdefault("LOCAL_RANK", str(cfg.local_rank))
    apply_accelerate_env(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        device = torch.device("cpu")
    # A finite timeout turns a lost rank or node into an error on every other rank instead of a silent hang.
    ensure_distributed(timeout=timedelta(minutes=cfg.run.dist_timeout_minutes))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_mean(values: dict[str, float], device) -> dict[str, float]:
    """Average scalar metrics over ranks (one collective for the whole dict)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1) or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def agree_max(value: int, device) -> int:
    """The largest `value` over ranks. ZeRO reduces gradients (and ZeRO-3 gathers weights) inside every
    forward/backward, so all ranks must run the same number of micro-batches or the collectives deadlock."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
