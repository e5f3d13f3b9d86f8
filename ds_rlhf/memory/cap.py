"""`run.max_gpu_memory_gb`: one cap per GPU for the trainer and vLLM together (e.g. 24 on a card shared with
others, or to rehearse a 24 GiB card on a bigger one).

Three parts, all derived from the cap C and the device's total memory T:

- `check_memory_cap` (called by `run/preflight_memory.py`, before any process group or model): the memory plan
  (`plan.plan_memory`, the numbers of `ds-rlhf memory`) of the configured run on a GPU of min(C, T) bytes;
  when it does not fit, one `ConfigError` line naming the biggest contributors and the settings that would shrink
  them. Without a visible GPU it plans for a GPU of exactly C (what the run would need there);
- `vllm_memory_fraction`: with the cap, `rollout.gpu_memory_utilization` is vLLM's share *of the cap*; vLLM itself
  reads a fraction of the whole GPU, so it gets `utilization * min(C, T) / T` (`recipes/rl_build.py` passes it);
- `trainer_memory_fraction` / `apply_trainer_cap`: `torch.cuda.set_per_process_memory_fraction` for the trainer's
  process: min(C, T) / T colocated (vLLM allocates inside this process, within the same cap) and disaggregated
  (vLLM is on other GPUs); with the sidecar the trainer's share of the cap minus vLLM's, as without a cap.

- `allow_unmapped`: PyTorch's allocator keeps counting a sleeping in-process vLLM's memory pool, which vLLM has
  unmapped (measured on the H200, 8B PPO under a 24 GiB cap: "23.05 GiB is allocated by PyTorch" while the process
  held 5.97 GiB of the device), so with the colocated engine asleep the trainer had only the cap minus vLLM's whole
  pool. The colocated engine reports its unmapped bytes after every sleep and wake; the fraction becomes
  (cap + unmapped) / T, so the cap stays on what the device holds.

- `non_torch_bytes`: the fraction caps PyTorch's caching allocator only; the CUDA context, NCCL's and vLLM's
  non-torch buffers, the driver's reserve (what NVML counts beyond CUDA's total) and other processes on the GPU sit
  outside it. Measured on the H200 (8B GRPO / PPO under a 24 GiB cap, fraction = cap / T): the allocator grew to its
  limit while training and NVML read 24.97 / 25.03 GiB. Every time the fraction is set it is lowered by what the
  device holds outside this process's allocator, measured then (NVML where pynvml is installed, as `nvidia-smi`
  and the benchmarks read it, else CUDA's free memory), plus `HEADROOM` for buffers created later, but by no more
  than the plan's reserve (`plan.DEFAULT_RESERVE_GB`, 2 GiB on GPUs, which stands for the same bytes): the
  preflight already checked that the plan fits the cap less that reserve, and neither measurement can tell this
  process's bytes from another process's on the same GPU (a card shared with others), which must not shrink the
  cap to nothing. The bytes measured are printed (`[rl] run.max_gpu_memory_gb=...`), with a warning when they
  exceed the reserve.
"""

from __future__ import annotations

import os

from ds_rlhf.errors import ConfigError
from ds_rlhf.memory.plan import DEFAULT_RESERVE_GB, GiB, MemoryPlan, fmt_bytes, plan_memory, remedies
from ds_rlhf.memory.role_plan import RolePlan

HEADROOM = 512 << 20  # for non-torch buffers created after a measurement (NCCL's, cuBLAS handles, vLLM's)
RESERVE = int(DEFAULT_RESERVE_GB["cuda"] * GiB)  # the plan's reserve: the most taken off the cap for those bytes


def cap_bytes(cfg) -> int:
    return int(cfg.run.max_gpu_memory_gb * GiB)


def capped_total(cfg, total_bytes: int) -> int:
    """The bytes this run may use per GPU: the cap, or the whole device when there is none (or it is larger)."""
    cap = cap_bytes(cfg)
    return min(cap, total_bytes) if cap > 0 else total_bytes


def vllm_memory_fraction(cfg, total_bytes: int) -> float:
    """The `gpu_memory_utilization` to give vLLM on a device of `total_bytes`: `rollout.gpu_memory_utilization` of
    the cap when `run.max_gpu_memory_gb` is set, else the setting itself."""
    util = cfg.rollout.gpu_memory_utilization
    if cap_bytes(cfg) <= 0 or total_bytes <= 0:
        return util
    return util * capped_total(cfg, total_bytes) / total_bytes


def trainer_memory_fraction(cfg, total_bytes: int, placement: str) -> float | None:
    """The trainer process's `set_per_process_memory_fraction`, or None to leave the allocator alone (no cap, and
    not the sidecar, whose split existed before the cap: the trainer takes what vLLM's process does not)."""
    capped = cap_bytes(cfg) > 0 and total_bytes > 0
    share = capped_total(cfg, total_bytes) / total_bytes if capped else 1.0
    if placement == "sidecar":
        return max(0.05, share * (1.0 - cfg.rollout.gpu_memory_utilization) - 0.02)
    return share if capped else None


def apply_trainer_cap(cfg, device, placement: str) -> float | None:
    """Apply `trainer_memory_fraction` on a CUDA `device`, less what the device holds outside this process's
    allocator (`non_torch_bytes`) under a cap; returns the fraction set (None: nothing set)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    fraction = trainer_memory_fraction(cfg, total, placement)
    if fraction is None:
        return None
    if cap_bytes(cfg) > 0 and placement != "sidecar":
        _APPLIED[_index(device)] = (int(fraction * total), int(total))
        return allow_unmapped(device, 0)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


_APPLIED: dict[int, tuple[int, int]] = {}  # CUDA device index -> (capped bytes, device total), from apply_trainer_cap


def _index(device) -> int:
    import torch

    index = getattr(device, "index", None)
    return torch.cuda.current_device() if index is None else int(index)


def non_torch_bytes(device, unmapped: int = 0) -> int | None:
    """Bytes the device holds outside this process's PyTorch allocator (see the module docstring): NVML's used
    memory (else CUDA's total - free) minus the allocator's reserved bytes that are mapped (`unmapped`: counted by
    the allocator, not held by the device); this process's and any other process's alike. None where nothing can
    be measured (no CUDA)."""
    import torch

    try:
        free, total = torch.cuda.mem_get_info(device)  # also creates the CUDA context, which then counts
    except Exception:  # noqa: BLE001 - no CUDA here (tests, CPU): nothing to measure
        return None
    try:
        used = int(torch.cuda.device_memory_used(device))  # NVML: includes the driver's reserve
    except Exception:  # noqa: BLE001 - no pynvml: CUDA's view
        used = int(total - free)
    held = max(0, int(torch.cuda.memory_reserved(device)) - max(0, int(unmapped)))
    return max(0, used - held)


_OUTSIDE: dict[int, int] = {}  # CUDA device index -> non-torch bytes at the last allow_unmapped (for the log line)


def outside_bytes(device) -> int | None:
    """What `allow_unmapped` last measured outside the allocator on `device` (None: not measured)."""
    return _OUTSIDE.get(_index(device))


def outside_warning(outside: int | None) -> str | None:
    """A warning line when the bytes measured outside the allocator exceed the plan's reserve (other processes on
    the GPU?): the cap then holds PyTorch to the cap less the reserve, not the device to the cap."""
    if outside is None or outside <= RESERVE:
        return None
    return (f"warning: run.max_gpu_memory_gb: {fmt_bytes(outside)} of this GPU is held outside this process's "
            f"PyTorch allocator (CUDA context, driver reserve, other processes), more than the plan's "
            f"{fmt_bytes(RESERVE)} reserve; the trainer's allocator is held to the cap less {fmt_bytes(RESERVE)}, "
            "and the device as a whole may exceed the cap")


def allow_unmapped(device, nbytes: int) -> float | None:
    """Set the trainer's fraction to (cap - min(non-torch bytes + `HEADROOM`, the plan's reserve) + `nbytes`) / T,
    `nbytes` being bytes that PyTorch's allocator counts but the device does not hold (a sleeping colocated vLLM's
    pool; see the module docstring). None (nothing set) when `apply_trainer_cap` set no cap on this device."""
    import torch

    index = _index(device)
    applied = _APPLIED.get(index)
    if applied is None:
        return None
    capped, total = applied
    nbytes = max(0, int(nbytes))
    outside = non_torch_bytes(device, nbytes)
    room = 0
    if outside is not None:
        _OUTSIDE[index] = outside
        room = min(outside + HEADROOM, RESERVE)
    fraction = min(1.0, max(0.01, (capped - room + nbytes) / total))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def local_gpu_total() -> int | None:
    """Total bytes of this rank's GPU (LOCAL_RANK), None without one. Touches CUDA only when asked."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
    return int(torch.cuda.get_device_properties(index).total_memory)


def _contribution(role: RolePlan, phase: str, plan: MemoryPlan) -> int:
    """A role's bytes in the plan's `phase` (an attribution for the message, not the plan's arithmetic)."""
    if role.role == "vllm":
        return role.params + role.activations + role.kv_cache
    if role.role.startswith("rollout"):
        return role.device_total
    return role.resident if phase == "rollout" else role.states + role.buffers + role.activations


def cap_message(cfg, plan: MemoryPlan, kind: str) -> str:
    """One line: the need against the cap, the three biggest contributors, what to change."""
    s = plan.settings
    phase = max(plan.phases, key=plan.phases.get)
    need = plan.peak + s.reserve
    parts = sorted(((_contribution(r, phase, plan), r.role) for r in plan.roles), reverse=True)
    biggest = ", ".join(f"{role} {fmt_bytes(n)}" for n, role in parts[:3] if n > 0)
    rollout = next((r for r in plan.roles if r.role == "vllm" or r.role.startswith("rollout")), None)
    fixes = [n.removeprefix("FAIL: ") for n in plan.notes if n.startswith("FAIL")]
    fixes += remedies(cfg, list(plan.roles), rollout, plan.phases, s)
    seen = list(dict.fromkeys(fixes))  # first mention of each, in order
    return (f"run.max_gpu_memory_gb={cfg.run.max_gpu_memory_gb:g}: this {kind} run needs about {fmt_bytes(need)} "
            f"per GPU at its {phase} peak (reserve {fmt_bytes(s.reserve)} included), more than the cap of "
            f"{fmt_bytes(s.capacity)}; biggest: {biggest or 'n/a'}; to fit: {'; '.join(seen) or 'a bigger cap'} "
            f"(`ds-rlhf memory --kind {kind}` with the same arguments prints the whole plan)")


def check_memory_cap(cfg, *, kind: str = "rl", total_bytes: int | None = None,
                     world_size: int | None = None) -> MemoryPlan | None:
    """Raise `ConfigError` when the run's plan does not fit `run.max_gpu_memory_gb` (see module docstring); the plan
    when it fits, None when there is no cap. `total_bytes`: the GPU's memory (default: this rank's GPU, else the
    cap); `world_size` default $WORLD_SIZE or 1. Reads only config.json files: no weights load."""
    cap = cap_bytes(cfg)
    if cap <= 0:
        return None
    total = total_bytes if total_bytes is not None else (local_gpu_total() or cap)
    world = world_size or int(os.environ.get("WORLD_SIZE", 1))
    capacity = capped_total(cfg, total)
    plan = plan_memory(cfg, kind=kind, device="cuda", capacity=capacity, device_name=f"{fmt_bytes(capacity)} cap",
                       world_size=world)
    if not plan.fits:
        raise ConfigError(cap_message(cfg, plan, kind))
    return plan
