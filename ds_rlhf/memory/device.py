"""The whole-device peak of an RL run on one GPU, as NVML (`nvidia-smi`'s memory.used) reads it: the memory plan
(`plan.py`, the bytes PyTorch's allocators are asked for) plus what each process on the GPU holds beyond them.

`device_peak` adds to a plan's phase (per GPU):

- `NVML_BASELINE`: what NVML counts as used on the idle GPU (the driver's reserve), before any process starts;
- the trainer's process: `TRAINER_OVERHEAD` bytes (its CUDA context, cuBLAS / NCCL buffers, the weight-sync
  channel to the engines, the allocator's cached blocks and the final checkpoint's transient buffers) and, in the
  train phase, the largest trained role's activations x `ACTIVATION_FACTOR` instead of x 1 (the allocator's
  fragmentation under a micro-batch's tensors, and what the per-token activation estimate misses on the GPU);
- each sidecar vLLM engine (its own process): `VLLM_OUTSIDE_BUDGET` beyond its `gpu_memory_utilization` budget.
  vLLM's worker (`vllm/v1/worker/gpu_worker.py`, 0.2x) takes its `MemorySnapshot` after the CUDA context and its
  distributed init exist, and sizes the KV cache as `total x gpu_memory_utilization` minus the weights, the
  profiling forward's torch peak, the non-torch bytes added since that snapshot and (vLLM >= 0.21,
  `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` on by default) its CUDA graph estimate: so the budget holds the
  weights, warm-up, CUDA graphs and KV cache, and the CUDA context, what the process allocated before the snapshot
  and what it allocates later outside torch (the weight-sync channel to the trainer) sit on top of it. With a KV
  cache of a given size (`kv_cache_memory_bytes`: by the work, `engine_budget.py`) the budget is the plan's
  weights, warm-up and that cache, and the same bytes sit on top of it (an assumption: measured with the share).

The constants are fitted to two H200 runs of `bench/rl_step_gpu.py` (0.5B Qwen2 shape, GRPO, 32 prompts x 8
samples x 256 new tokens, ZeRO-2 bf16, two sidecar engines), caps 48 and 80 GiB, split by `split.choose_split`:

- cap 48 GiB: vLLM budget 0.19 x 48 = 9.12 GiB, micro-batch 16384 tokens; the plan's trainer part 30.91 GiB
  (activations 22.61); NVML idle 0.60, with the trainer loaded 6.37, after both engines started 19.12, peak of the
  run 51.04 GiB; the trainer's `max_memory_allocated` 32.12 GiB;
- cap 80 GiB: vLLM budget 0.11 x 80 = 8.80 GiB, micro-batch 32768 tokens; the plan's trainer part 50.62 GiB
  (activations 42.33); NVML idle 0.60, 6.37, 18.78, peak 72.85 GiB; `max_memory_allocated` 56.15 GiB

(the 100 ms NVML timeline of each run's JSON; the peak is the run's, 0.38 GiB above the steady steps' in both: the
final checkpoint). The engines started after the trainer had loaded, one after the other, so the step from
"before the engines" to "after them" is both engines: 12.75 and 12.41 GiB, i.e. budget + 1.82 and + 1.81 GiB per
engine (`VLLM_OUTSIDE_BUDGET`: 1.85 GiB). The trainer's process is the rest: 51.04 - 0.60 - 12.75 = 37.68 GiB and
72.85 - 0.60 - 12.41 = 59.83 GiB. With the plan's trainer part = states S (8.29 GiB in both) + activations A,
trainer = S + C + f x A gives f = (59.83 - 37.68) / (42.33 - 22.61) = 1.124 and C = 37.68 - 8.29 - 1.124 x 22.61 =
3.98 GiB: `ACTIVATION_FACTOR` 1.13 and `TRAINER_OVERHEAD` 4 GiB, rounded up. The model states are left at x 1:
the plan's ZeRO-2 states were measured within 1% of the allocator's (`plan.py`). Two runs of one shape fix two
constants: `bench/rl_step_gpu.py` records each process's GPU memory at the run's peak (`gpu_processes`), which
splits the trainer's share between its allocator and the rest on the next run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_rlhf.memory.plan import GiB, MemoryPlan

NVML_BASELINE = int(0.625 * GiB)  # NVML's used memory on the idle H200: 0.60 GiB measured
TRAINER_OVERHEAD = 4 * GiB  # the trainer's process beyond its allocations: 3.98 GiB fitted (module docstring)
ACTIVATION_FACTOR = 1.13  # the trainer's activations on the device per planned byte: 1.124 fitted
VLLM_OUTSIDE_BUDGET = int(1.85 * GiB)  # per sidecar engine beyond gpu_memory_utilization: 1.82 / 1.81 measured


@dataclass(frozen=True)
class DevicePeak:
    """The whole-device peak per GPU (`total`) and what it adds to the plan's peak phase."""

    total: int
    phase: str
    plan: int  # the plan's bytes in that phase
    baseline: int
    trainer: int  # TRAINER_OVERHEAD, plus the activations' factor in the train phase
    engines: int  # VLLM_OUTSIDE_BUDGET x the sidecar engines on this GPU

    def to_dict(self) -> dict:
        return {"device_peak_bytes": self.total, "phase": self.phase, "plan_bytes": self.plan,
                "nvml_baseline_bytes": self.baseline, "trainer_overhead_bytes": self.trainer,
                "engines_outside_budget_bytes": self.engines}


def sidecar_engines_on_gpu(cfg, plan: MemoryPlan) -> int:
    """vLLM processes of their own on the training GPU: the sidecar's engines (0 for other placements/backends)."""
    s = plan.settings
    if s.rollout != "vllm" or s.placement != "sidecar" or s.device != "cuda":
        return 0
    return cfg.rollout.sidecar_engines


def activations_in_train_phase(plan: MemoryPlan) -> int:
    """The largest trained role's activations: what the plan's train phase holds for one micro-batch."""
    trained = [r for r in plan.roles if r.role != "vllm" and not r.role.startswith("rollout")]
    return max((r.activations for r in trained), default=0)


def device_peak(cfg, plan: MemoryPlan) -> DevicePeak:
    """The whole-device peak of `plan` (a plan of `cfg`, on CUDA) as NVML would read it (module docstring)."""
    engines = sidecar_engines_on_gpu(cfg, plan) * VLLM_OUTSIDE_BUDGET
    extra_acts = int((ACTIVATION_FACTOR - 1) * activations_in_train_phase(plan))
    best = None
    for phase, planned in plan.phases.items():
        trainer = TRAINER_OVERHEAD + (extra_acts if phase == "train" else 0)
        total = planned + NVML_BASELINE + trainer + engines
        if best is None or total > best.total:
            best = DevicePeak(total, phase, planned, NVML_BASELINE, trainer, engines)
    return best or DevicePeak(NVML_BASELINE, "none", 0, NVML_BASELINE, 0, 0)
