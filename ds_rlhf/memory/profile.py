"""`--run.profile_memory`: peak memory per phase of each RL step, measured against `ds-rlhf memory`'s plan.

The PhaseTimer calls `enter` / `exit` around every phase. On a GPU a phase's peak is the CUDA allocator's peak
inside it (reset at its start); on CPU (where the plan's "device" is RAM) it is the resident set at its end. The
plan's two phases are compared with the measured ones they cover: its rollout phase with rollout / reward / sync,
its train phase with the forward passes and the update. `memory/other_frac` is the share of the measured peak the
plan does not explain; above 5% the profiler says so once, naming the phase.
"""

from __future__ import annotations

import os

from ds_rlhf.memory.cap import capped_total
from ds_rlhf.memory.plan import plan_memory

GiB = 1 << 30
PLAN_PHASE = {"rollout": "rollout", "reward": "rollout", "sync": "rollout", "data": "rollout",
              "old_logp": "train", "reference": "train", "critic": "train", "train": "train"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryProfiler:
    def __init__(self, cfg, device, world_size: int, announce=print):
        import torch

        self.cuda = device.type == "cuda"
        capacity = (capped_total(cfg, torch.cuda.get_device_properties(device).total_memory) if self.cuda
                    else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # GPU: run.max_gpu_memory_gb
        self.plan = plan_memory(cfg, kind="rl", device=device.type, capacity=capacity, world_size=world_size)
        self.announce, self.peaks, self.warned = announce, {}, False
        self.base = 0 if self.cuda else _rss()  # on CPU, the process before any model: not in the plan

    def enter(self, name: str) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def exit(self, name: str) -> None:
        if self.cuda:
            import torch

            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _rss() - self.base
        self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def step_metrics(self) -> dict[str, float]:
        """This step's measured peaks per phase, the plan's, and the unexplained share; resets for the next step."""
        out, worst = {}, (0.0, "")
        for name, peak in sorted(self.peaks.items()):
            out[f"memory/{name}_peak_gib"] = peak / GiB
            planned = self.plan.phases.get(PLAN_PHASE.get(name, "train"), 0)
            other = (peak - planned) / peak if peak > 0 else 0.0
            worst = max(worst, (other, name))
        for phase, planned in self.plan.phases.items():
            out[f"memory/plan_{phase}_gib"] = planned / GiB
        out["memory/other_frac"] = worst[0]
        if worst[0] > 0.05 and not self.warned:
            self.warned = True
            self.announce(f"[memory] phase {worst[1]}: {worst[0]:.0%} of its measured peak is not in the plan "
                          "(`ds-rlhf memory` under-counts something here: allocator caching, another process' "
                          "buffers, or a category it does not model)")
        self.peaks.clear()
        return out
