"""The memory side of `rl_step_gpu.py`: the split a capped run picks, the device's size (without starting CUDA
under an SM split) and the split values the run trained with."""

from __future__ import annotations


def memory_split(cfg, total: int | None) -> dict | None:
    """The split of the cap the run picks (`memory/split.py`, planned on a copy before the run starts), or None
    without a cap; `used` is filled in with the values the run then trained with."""
    from ds_rlhf.memory.split import choose_split

    if cfg.run.max_gpu_memory_gb <= 0:
        return None
    split = choose_split(cfg, total or int(cfg.run.max_gpu_memory_gb * 1024 ** 3))
    return {"max_gpu_memory_gb": cfg.run.max_gpu_memory_gb, **(split.to_dict() if split else {"picked": []})}


def device_total_bytes(cfg) -> int | None:
    """GPU 0's memory: torch's figure, or under rollout.sm_split NVML's (the trainer's CUDA must start after the
    split's MPS variables are set: `RLTrainer` starts them; torch's query would start CUDA here first)."""
    import torch

    if cfg.rollout.sm_split == "off":
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:  # noqa: BLE001  no NVML: the cap itself stands for the device
        return None


def used_split(cfg) -> dict:
    r = cfg.rollout
    return {"rollout.gpu_memory_utilization": r.gpu_memory_utilization,
            "data.micro_batch_tokens": cfg.data.micro_batch_tokens, "rollout.sidecar_engines": r.sidecar_engines}
