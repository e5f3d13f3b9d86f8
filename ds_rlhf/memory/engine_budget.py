"""What the vLLM engines on the trainer's GPU take when the user leaves their memory unset: the KV cache the work
needs (`kv_cache.vllm_kv_cache`, source "work") beside each engine's weights and warm-up, and the share of the
device that is (`rollout.gpu_memory_utilization`, written into the config as the cap's split writes its picks).

vLLM gets the KV cache as `kv_cache_memory_bytes` (it allocates exactly that and skips its profile-based sizing)
and the share as `gpu_memory_utilization`: with the KV cache given, vLLM (0.2x, 0.32: `request_memory` in
`vllm/v1/worker/utils.py`) still refuses to start when less than that share of the device is free, and the sidecar
trainer's allocator takes the rest of the device less that share (`cap.trainer_memory_fraction`). The share is the
engines' bytes in the memory plan (weights, warm-up, KV cache; `plan.plan_rollout`) over the device's, rounded up to
0.01, at most 1. With `rollout.weight_transport shared` the engines hold no weights: their one copy is the trainer's
buffer, left to the trainer's allocator (`plan.shared_weights_row`).

With `rollout.kv_cache_gb` the KV cache is the user's and the share follows it the same way.
`choose_engine_budget` is pure (it plans the config; no weights load); `apply_engine_budget` writes the share into
the config. `engine_share` is the share of the trainer's GPU the engines take, whoever sizes them: the one rule the
RL build (`recipes/rl_build.py`, which starts the engines with it and logs `EngineBudget.line()`) and the JSD
memory preflight (`run/preflight_memory.py`, which leaves the rest to the trainer) both call; `ds-rlhf memory`
shows the same plan.

The run directory records the budget (`record_engine_budget`, rank 0, by the RL build): its config.json holds the
share and the KV cache the engines got (`recorded_settings`: `rollout.gpu_memory_utilization`, and
`rollout.kv_cache_gb` where the work sized it), so it says what ran and `--config config.json` starts the same
engines (both given: vLLM gets the same share and `kv_cache_memory_bytes`); `engine_budget.json` beside it holds the
budget and names those keys as the run's choice, not the user's (a key the user gave is never chosen: no budget
then). A resume with the run's own command line computes the same budget again (pure, on the same device). No budget
wherever the user's `rollout.gpu_memory_utilization`, `run.max_gpu_memory_gb` (its split) or a disaggregated
server (GPUs of its own) decide instead.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.atomic_files import write_text_atomic
from ds_rlhf.config import set_value
from ds_rlhf.memory import meta_models
from ds_rlhf.memory.cap import vllm_memory_fraction
from ds_rlhf.memory.kv_cache import GiB, KVCacheSize, share_by_engines, vllm_kv_cache
from ds_rlhf.memory.plan import fmt_bytes, plan_memory
from ds_rlhf.memory.settings import rollout_backend


@dataclass(frozen=True)
class EngineBudget:
    """The engines' memory on one device: their KV cache (all engines together) and the share of the device."""

    kv: KVCacheSize
    engine_bytes: int  # the engines' bytes beside the KV cache: weights, warm-up, CUDA graphs
    engines: int
    device_total: int
    fraction: float  # rollout.gpu_memory_utilization: of the whole device, all engines together
    own_weights: bool = True  # False: the engines read the trainer's buffer (rollout.weight_transport shared)

    @property
    def total(self) -> int:
        return self.kv.bytes + self.engine_bytes

    def line(self) -> str:
        """One line for the run log: the KV cache chosen and why, and the share it makes."""
        each = f" ({fmt_bytes(self.kv.bytes // self.engines)} per engine)" if self.engines > 1 else ""
        beside = "weights and warm-up" if self.own_weights else "warm-up (the weights are the trainer's shared buffer)"
        return (f"[rl] vLLM KV cache {fmt_bytes(self.kv.bytes)}{each}, {self.kv.detail}; with {beside} "
                f"{fmt_bytes(self.total)}: rollout.gpu_memory_utilization {self.fraction:g} of the "
                f"{fmt_bytes(self.device_total)} device"
                + (" (rollout.kv_cache_gb or rollout.gpu_memory_utilization sizes it instead)"
                   if self.kv.source == "work" else ""))

    def to_dict(self) -> dict:
        return {"kv_cache_bytes": self.kv.bytes, "kv_source": self.kv.source, "kv_detail": self.kv.detail,
                "engine_bytes": self.engine_bytes, "engines": self.engines, "device_total_bytes": self.device_total,
                "gpu_memory_utilization": self.fraction}


def choose_engine_budget(cfg, device_total: int, *, world_size: int = 1) -> EngineBudget | None:
    """The engines' KV cache and device share for the RL run of `cfg` on a GPU of `device_total` bytes (module
    docstring); None where the user's settings, a cap's split or vLLM's own sizing decide."""
    if not share_by_engines(cfg) or rollout_backend(cfg, "cuda") != "vllm" or device_total <= 0:
        return None
    plan = plan_memory(cfg, kind="rl", device="cuda", capacity=int(device_total), world_size=world_size)
    row = next(r for r in plan.roles if r.role == "vllm")
    size = vllm_kv_cache(cfg, meta_models.hf_config(cfg.model.path), device="cuda", host_bytes=int(device_total),
                         world_size=world_size, engine_bytes=row.params + row.activations)
    total = row.params + row.activations + row.kv_cache
    fraction = min(1.0, math.ceil(total / device_total * 100 - 1e-9) / 100)
    engines = cfg.rollout.sidecar_engines if cfg.rollout.placement == "sidecar" else 1
    return EngineBudget(size, row.params + row.activations, engines, int(device_total), fraction, row.params > 0)


def apply_engine_budget(cfg, budget: EngineBudget) -> None:
    """Write the budget's share into `cfg` (`rollout.gpu_memory_utilization`; not a key the user gave)."""
    set_value(cfg, "rollout.gpu_memory_utilization", budget.fraction)


def engine_share(cfg, device_total: int, *, world_size: int = 1) -> tuple[float, EngineBudget | None]:
    """(the share of the trainer's GPU of `device_total` bytes the run's vLLM engines take, the budget by the work
    or None): 0 with the HF backend or a disaggregated server (GPUs of its own), the budget's share where the
    engines are sized by their work (`choose_engine_budget`), else `rollout.gpu_memory_utilization` (of the cap
    under `run.max_gpu_memory_gb`, `cap.vllm_memory_fraction`). Pure; the caller applies the budget."""
    if rollout_backend(cfg, "cuda") != "vllm" or cfg.rollout.placement == "disaggregated":
        return 0.0, None
    budget = choose_engine_budget(cfg, device_total, world_size=world_size)
    return (budget.fraction if budget else vllm_memory_fraction(cfg, device_total)), budget


def recorded_settings(budget: EngineBudget) -> dict[str, float]:
    """The settings that start the same engines when given (`--config` of the run's config.json): the share, and
    the KV cache where the work sized it (`rollout.kv_cache_gb`: whole MiB, exact as a float of GiB)."""
    out = {"rollout.gpu_memory_utilization": budget.fraction}
    if budget.kv.source == "work":
        out["rollout.kv_cache_gb"] = budget.kv.bytes / GiB
    return out


BUDGET_FILE = "engine_budget.json"  # in the run directory, beside config.json


def record_engine_budget(cfg, budget: EngineBudget | None, run_dir: str | Path) -> None:
    """Write `budget` into the run directory: config.json as `cfg` with `recorded_settings`, and `BUDGET_FILE`
    (the budget and the settings it chose; module docstring). No budget: an earlier run's `BUDGET_FILE` goes (the
    run's config.json, written at set-up, holds what sizes the engines)."""
    path = Path(run_dir) / BUDGET_FILE
    if budget is None:
        path.unlink(missing_ok=True)
        return
    recorded = copy.deepcopy(cfg)
    chosen = recorded_settings(budget)
    for key, value in chosen.items():
        set_value(recorded, key, value)
    recorded.save(Path(run_dir) / "config.json")
    record = {**budget.to_dict(), "chosen_settings": chosen}
    write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
