"""GPU utilisation and memory (NVML when a GPU exists), process memory otherwise."""

from __future__ import annotations

import resource

_NVML = None


def nvml_module():
    """The pynvml module, initialised once per process; False where NVML or a GPU is missing."""
    global _NVML
    if _NVML is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # no NVML library or no GPU: fall back quietly, this is telemetry
            _NVML = False
    return _NVML


def system_stats(device_index: int = 0) -> dict[str, float]:
    import torch

    stats = {"sys/cpu_max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        stats["sys/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        stats["sys/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        nvml = nvml_module()
        if nvml:
            handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            stats["sys/gpu_util_pct"] = float(util.gpu)
            stats["sys/gpu_mem_used_gb"] = mem.used / 2**30
    return stats
