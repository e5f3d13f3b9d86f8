"""The split of `run.max_gpu_memory_gb` between vLLM and the trainer, chosen from the memory plan (`plan.py`).

With a cap C on a device of T bytes (the run may use min(C, T) = M per GPU), an RL run picks what the user left
unset (`Config.given`: keys a --config file or the command line set are never changed):

- `rollout.gpu_memory_utilization` (vLLM's share of the cap, the vLLM backend only): what vLLM needs for one step
  in one wave, split over the engines. The KV cache for the step's sequences (`rl.prompts_per_step` x
  `rollout.n_samples`, x the ranks or TP ranks one engine serves, as the plan counts them) of
  `data.max_prompt_len + rollout.max_new_tokens` tokens (or `rollout.max_model_len`), rounded up to vLLM's
  16-token blocks, at the model's KV bytes per token, times `kv_cache.KV_HEADROOM` (`kv_cache.work_kv_bytes`, as
  without a cap); plus, per engine, the plan's weights and `kv_cache.engine_warmup_bytes` (its profiling forward,
  or vLLM's sampler warm-up when that is larger, plus CUDA graphs and the non-torch buffers of its profiling).
  Rounded up to 0.01 of M. Each engine's CUDA context and what it allocates before vLLM measures its budget sit
  outside the budget (`device.VLLM_OUTSIDE_BUDGET`, counted in the whole-device peak);
- `data.micro_batch_tokens`: the largest of `MICRO_BATCH_CANDIDATES` (at least one sequence long, at most the
  first that holds the whole step) whose plan, with that vLLM share, fits the cap less the plan's reserve, and whose
  whole-device peak (`device.device_peak`: the plan plus NVML's idle baseline, the trainer process's overhead and
  activation factor, and each sidecar engine's bytes beyond its budget, fitted to H200 runs of the bench) stays
  under M x (1 - `MARGIN`). With the sidecar the trainer's allocations (its planned part, activations x the
  factor) must also fit the allocator fraction the trainer process gets (`cap.trainer_memory_fraction`);
- `model.gradient_checkpointing`: turned on when it lets a micro-batch at least `CHECKPOINT_GAIN` times larger fit
  than the largest without it, and that one is small in work (`CHECKPOINT_BELOW_FLOP`), or nothing fits without it;
- `rollout.sidecar_engines` is kept (each engine holds its own weights and warm-up; only its warm-up with
  `rollout.weight_transport shared`), and lowered one at a time only when nothing fits with it.

`choose_split` is pure (it plans copies of the config); `apply_split` writes the picks into the config, and
`run/preflight_memory.py` calls both before it checks the cap. When nothing fits, one `ConfigError` line says what the
smallest split needs and what would shrink it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from ds_rlhf.config import set_value
from ds_rlhf.engines.memory import precision_bytes
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory import meta_models
from ds_rlhf.memory.cap import capped_total, trainer_memory_fraction, vllm_memory_fraction
from ds_rlhf.memory.device import ACTIVATION_FACTOR, DevicePeak, activations_in_train_phase, device_peak
from ds_rlhf.memory.kv_cache import (
    GPU_BLOCK_TOKENS,
    KV_HEADROOM,
    engine_warmup_bytes,
    kv_bytes_per_token,
    work_kv_bytes,
)
from ds_rlhf.memory.plan import MemoryPlan, fmt_bytes, plan_memory, remedies
from ds_rlhf.memory.settings import rollout_backend

MICRO_BATCH_CANDIDATES = (131072, 98304, 65536, 49152, 32768, 24576, 16384, 12288, 8192, 6144, 4096, 3072, 2048,
                          1024, 512)
# of the capped bytes, kept free beyond the whole-device peak: what its two-run fit has not seen (NVML's 100 ms
# samples miss shorter spikes; other shapes). The fit itself is above both measured peaks (by 0.25 and 0.40 GiB)
MARGIN = 0.04
MAX_VLLM_SHARE = 0.9  # of the cap: vLLM alone never takes more
KEYS = ("rollout.gpu_memory_utilization", "data.micro_batch_tokens", "rollout.sidecar_engines",
        "model.gradient_checkpointing")
# gradient checkpointing is turned on when without it the largest fitting micro-batch is small in work (its forward
# and backward, 6 x parameters x tokens, below `CHECKPOINT_BELOW_FLOP`) and with it one at least `CHECKPOINT_GAIN`
# times larger fits: such a step is bound by the fixed cost of each micro-batch (launches, hooks, gradient buckets),
# not its FLOPs, so fewer micro-batches beat the recomputed forward
CHECKPOINT_BELOW_FLOP = 24e12
CHECKPOINT_GAIN = 2


@dataclass(frozen=True)
class Split:
    """The chosen settings (every key of `KEYS`, the user's where given) and why."""

    gpu_memory_utilization: float  # of the cap (the config's meaning under a cap)
    micro_batch_tokens: int
    sidecar_engines: int
    picked: tuple[str, ...]  # the keys chosen here
    user: tuple[str, ...]  # the keys the user set (`Config.given`), left as they are
    capacity: int  # bytes per GPU the run may use: min(cap, device)
    device_total: int
    vllm_fraction: float  # of the whole GPU, as vLLM is given it
    peak: int  # the plan's peak per GPU (reserve excluded)
    reserve: int
    reasons: tuple[str, ...] = field(default=())
    backend: str = "vllm"  # the rollout backend the plan assumes (on a GPU): no vLLM share to pick without vLLM
    device: DevicePeak | None = None  # the whole-device peak NVML would read (`device.device_peak`)
    gradient_checkpointing: bool = False

    def values(self) -> dict:
        return {"rollout.gpu_memory_utilization": self.gpu_memory_utilization,
                "data.micro_batch_tokens": self.micro_batch_tokens, "rollout.sidecar_engines": self.sidecar_engines,
                "model.gradient_checkpointing": self.gradient_checkpointing}

    def to_dict(self) -> dict:
        return {**self.values(), "picked": list(self.picked), "user": list(self.user), "capacity_bytes": self.capacity,
                "device_total_bytes": self.device_total, "vllm_fraction_of_gpu": round(self.vllm_fraction, 4),
                "planned_peak_bytes": self.peak, "reserve_bytes": self.reserve, "reasons": list(self.reasons),
                "rollout_backend": self.backend,
                "planned_device_peak_bytes": self.device.total if self.device else None,
                "device_peak": self.device.to_dict() if self.device else None}

    def line(self, cap_gb: float, kind: str = "rl") -> str:
        """`[rl] run.max_gpu_memory_gb=48: vLLM 0.06 of the GPU (2 engines), micro-batch 16384 tokens (...)`."""
        tag = {k: ", yours" if k in self.user else "" for k in KEYS}
        engines = f"{self.sidecar_engines} engine{'s' if self.sidecar_engines > 1 else ''}"
        vllm = (f"vLLM {self.vllm_fraction:.3f} of the GPU (rollout.gpu_memory_utilization "
                f"{self.gpu_memory_utilization:g} of the cap{tag[KEYS[0]]}; {engines}{tag[KEYS[2]]})"
                if self.backend == "vllm" else f"rollout backend {self.backend} on a GPU (no vLLM share to pick)")
        d = self.device
        device = (f"planned device peak {fmt_bytes(d.total)} of {fmt_bytes(self.capacity)}, {MARGIN:.0%} kept free: "
                  f"plan {fmt_bytes(d.plan)} + idle {fmt_bytes(d.baseline)} + trainer process "
                  f"{fmt_bytes(d.trainer)}" + (f" + engines beyond their budget {fmt_bytes(d.engines)}"
                                               if d.engines else "") if d else
                  f"planned peak {fmt_bytes(self.peak)} + reserve {fmt_bytes(self.reserve)} of "
                  f"{fmt_bytes(self.capacity)}")
        checkpointing = (f", gradient checkpointing{tag[KEYS[3]]}" if self.gradient_checkpointing else "")
        return (f"[{kind}] run.max_gpu_memory_gb={cap_gb:g}: {vllm}, "
                f"micro-batch {self.micro_batch_tokens} tokens{tag[KEYS[1]]}{checkpointing} ({device}); "
                + "; ".join(self.reasons))


def user_set(cfg, key: str) -> bool:
    return key in getattr(cfg, "given", frozenset())


def _with(cfg, **values):
    """A copy of `cfg` with dotted-key values (the `given` keys kept)."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        set_value(out, key.replace("__", "."), value)
    return out


def _step_sequences(cfg, world_size: int) -> int:
    """Sequences one vLLM engine generates per step, as `plan.plan_rollout` counts them."""
    r = cfg.rollout
    return cfg.rl.prompts_per_step * r.n_samples * (world_size if r.placement == "disaggregated"
                                                    else r.tensor_parallel_size)


def vllm_share_bytes(cfg, plan: MemoryPlan, engines: int, world_size: int) -> tuple[int, str]:
    """Bytes vLLM needs under the cap for one step in one wave over `engines` engines (module docstring), and a
    phrase saying what they hold. `plan`: any plan of `cfg` with the vLLM backend (its vllm row's weights and
    profiling forward, which it counts for its own engine count)."""
    row = next(r for r in plan.roles if r.role == "vllm")
    planned_engines = cfg.rollout.sidecar_engines if cfg.rollout.placement == "sidecar" else 1
    hf = meta_models.hf_config(cfg.model.path)
    act = precision_bytes(plan.settings.rollout_precision)  # the engines' KV dtype (rollout.dtype)
    per_token = kv_bytes_per_token(hf, act, cfg.rollout.tensor_parallel_size)
    seqs = _step_sequences(cfg, world_size)
    kv = work_kv_bytes(per_token, seqs, plan.settings.seq_len, block=GPU_BLOCK_TOKENS, headroom=KV_HEADROOM)
    weights, profile = row.params // planned_engines, row.activations // planned_engines
    per_engine = weights + engine_warmup_bytes(profile, hf.vocab_size, cfg.rollout.max_num_seqs)
    what = (f"KV cache for {seqs} sequences of {plan.settings.seq_len} tokens x {KV_HEADROOM:g} "
            f"({fmt_bytes(kv)}) + {engines} x {fmt_bytes(per_engine)} (weights, warm-up, CUDA graphs)")
    return engines * per_engine + kv, what


def micro_batch_candidates(cfg, seq_len: int) -> list[int]:
    """`MICRO_BATCH_CANDIDATES` from one sequence up to the first that holds the whole step, largest first."""
    step = cfg.rl.prompts_per_step * cfg.rollout.n_samples * seq_len  # a rank's step
    fits = sorted(c for c in MICRO_BATCH_CANDIDATES if c >= seq_len)
    if not fits:
        return [seq_len]
    upto = next((i for i, c in enumerate(fits) if c >= step), len(fits) - 1)
    return list(reversed(fits[:upto + 1]))


def _plan(cfg, capacity: int, world_size: int) -> MemoryPlan:
    return plan_memory(cfg, kind="rl", device="cuda", capacity=capacity, device_name=f"{fmt_bytes(capacity)} cap",
                       world_size=world_size)


def _fits(cfg, plan: MemoryPlan, capacity: int, total: int, vllm_bytes: int) -> bool:
    """The plan fits the cap less the reserve, and its whole-device peak the cap less `MARGIN`; with the sidecar
    the trainer's allocations (its planned part, activations x `device.ACTIVATION_FACTOR`) also fit the allocator
    fraction its process gets."""
    if not plan.fits or device_peak(cfg, plan).total > capacity * (1 - MARGIN):
        return False
    if cfg.rollout.placement == "sidecar" and plan.settings.rollout == "vllm":
        trainer = _trainer_allocations(plan, vllm_bytes)
        return trainer <= trainer_memory_fraction(cfg, total, "sidecar") * total
    return True


def _trainer_allocations(plan: MemoryPlan, vllm_bytes: int) -> int:
    """The sidecar trainer's allocator bytes at the plan's peak: its part of the plan (the engines' budget off),
    its activations scaled as `device.device_peak` scales them."""
    extra = int((ACTIVATION_FACTOR - 1) * activations_in_train_phase(plan))
    return plan.peak - vllm_bytes + extra


def choose_split(cfg, device_total_bytes: int, *, world_size: int = 1) -> Split | None:
    """The split of `run.max_gpu_memory_gb` for the RL run of `cfg` on a device of `device_total_bytes` (module
    docstring); None without a cap. Raises `ConfigError` (one line) when no split fits."""
    if cfg.run.max_gpu_memory_gb <= 0:
        return None
    total = int(device_total_bytes)
    capacity = capped_total(cfg, total)
    vllm = rollout_backend(cfg, "cuda") == "vllm"
    pick_util = vllm and not user_set(cfg, KEYS[0])
    pick_tokens = not user_set(cfg, KEYS[1])
    if not (pick_util or pick_tokens):
        return None  # the user's split: `cap.check_memory_cap` alone says whether it fits
    sidecar = cfg.rollout.placement == "sidecar"
    engine_counts = ([cfg.rollout.sidecar_engines] if not sidecar or user_set(cfg, KEYS[2])
                     else list(range(cfg.rollout.sidecar_engines, 0, -1)))
    last = None
    for engines in engine_counts:
        trial = _with(cfg, rollout__sidecar_engines=engines) if sidecar else cfg
        base = _plan(trial, capacity, world_size)
        reasons, vllm_bytes = [], 0
        util = cfg.rollout.gpu_memory_utilization
        if vllm:
            if pick_util:
                need, what = vllm_share_bytes(trial, base, engines, world_size)
                util = math.ceil(need / capacity * 100) / 100
                reasons.append(f"vLLM: {what} = {fmt_bytes(need)}")
                if util > MAX_VLLM_SHARE:
                    last = (trial, base, f"vLLM alone needs {fmt_bytes(need)} ({what}), more than "
                                         f"{MAX_VLLM_SHARE:.0%} of the cap")
                    continue
            vllm_bytes = int(util * capacity)
        trial = _with(trial, rollout__gpu_memory_utilization=util)
        seq_len = base.settings.seq_len
        candidates = (micro_batch_candidates(trial, seq_len) if pick_tokens
                      else [cfg.data.micro_batch_tokens])
        chosen = _micro_batch(cfg, trial, candidates, capacity, total, vllm_bytes, world_size, pick_tokens)
        if chosen is None:
            smallest = _with(trial, data__micro_batch_tokens=candidates[-1])
            last = (smallest, _plan(smallest, capacity, world_size),
                    f"the smallest micro-batch ({candidates[-1] or 'optim.micro_batch_size'} tokens)")
            continue
        tokens, plan, checkpointing, why = chosen
        reasons += why
        if sidecar and engines < cfg.rollout.sidecar_engines:
            reasons.append(f"{cfg.rollout.sidecar_engines} sidecar engines do not fit (a weight copy each)")
        picked = tuple(k for k, on in zip(KEYS, (pick_util, pick_tokens, sidecar and engines
                                                 != cfg.rollout.sidecar_engines,
                                                 checkpointing != cfg.model.gradient_checkpointing)) if on)
        user = tuple(k for k in KEYS if user_set(cfg, k))
        return Split(util, tokens, engines, picked, user, capacity, total, vllm_memory_fraction(trial, total),
                     plan.peak, plan.settings.reserve, tuple(reasons), plan.settings.rollout,
                     device_peak(trial, plan), checkpointing)
    raise ConfigError(_nothing_fits(cfg, capacity, last))


def _micro_batch(cfg, trial, candidates: list[int], capacity: int, total: int, vllm_bytes: int,
                 world_size: int, pick_tokens: bool) -> tuple[int, MemoryPlan, bool, list[str]] | None:
    """(tokens, plan, gradient checkpointing, reasons) of the largest fitting micro-batch; checkpointing turned on
    (where the user left it unset) when it lets a micro-batch `CHECKPOINT_GAIN` times larger fit than the one below
    `CHECKPOINT_BELOW_FLOP` of work without it (not with the user's micro-batch, `pick_tokens` false)."""
    on = cfg.model.gradient_checkpointing
    chosen = _largest_fitting(trial, candidates, capacity, total, vllm_bytes, world_size)
    why = ([f"micro-batch: the largest of {candidates[0]}..{candidates[-1]} whose planned device peak fits"]
           if pick_tokens else [])
    if on or user_set(cfg, KEYS[3]) or not pick_tokens or (chosen and _work(chosen) >= CHECKPOINT_BELOW_FLOP):
        return (*chosen, on, why) if chosen else None
    with_ckpt = _largest_fitting(_with(trial, model__gradient_checkpointing=True), candidates, capacity, total,
                                 vllm_bytes, world_size)
    if with_ckpt is None or (chosen and with_ckpt[0] < CHECKPOINT_GAIN * chosen[0]):
        return (*chosen, False, why) if chosen else None
    without = f"{chosen[0]} tokens" if chosen else "none"
    return (*with_ckpt, True, why + [f"gradient checkpointing: the largest micro-batch without it is {without}"])


def _work(chosen: tuple[int, MemoryPlan]) -> float:
    """A micro-batch's training FLOPs: 6 x the trained parameters x its tokens."""
    tokens, plan = chosen
    return 6.0 * sum(r.num_params for r in plan.roles if r.role == "actor") * tokens


def _largest_fitting(cfg, candidates: list[int], capacity: int, total: int, vllm_bytes: int,
                     world_size: int) -> tuple[int, MemoryPlan] | None:
    """The largest candidate (largest first; the planned peak grows with the tokens) whose plan fits, by binary
    search, with its plan."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = _plan(_with(cfg, data__micro_batch_tokens=candidates[mid]), capacity, world_size)
        if _fits(cfg, plan, capacity, total, vllm_bytes):
            best, hi = (candidates[mid], plan), mid - 1
        else:
            lo = mid + 1
    return best


def _nothing_fits(cfg, capacity: int, last) -> str:
    trial, plan, what = last
    s = plan.settings
    rollout = next((r for r in plan.roles if r.role == "vllm" or r.role.startswith("rollout")), None)
    fixes = [n.removeprefix("FAIL: ") for n in plan.notes if n.startswith("FAIL")]
    fixes += [f for f in remedies(trial, list(plan.roles), rollout, plan.phases, s)
              if "micro-batch" not in f and "gpu_memory_utilization" not in f]
    fixes = list(dict.fromkeys(fixes)) or ["a bigger cap"]
    device = device_peak(trial, plan).total
    return (f"run.max_gpu_memory_gb={cfg.run.max_gpu_memory_gb:g}: no split of the cap fits this rl run: with "
            f"{what} the plan needs about {fmt_bytes(plan.peak + s.reserve)} per GPU (reserve included), "
            f"{fmt_bytes(device)} of the whole device as NVML reads it, and {MARGIN:.0%} of the cap "
            f"({fmt_bytes(capacity)}) is kept free; to fit: {'; '.join(fixes)} "
            "(`ds-rlhf memory --kind rl` with the same arguments prints the plan)")


def apply_split(cfg, split: Split) -> None:
    """Write the picked keys of `split` into `cfg` (the user's keys are left as they are)."""
    values = split.values()
    for key in split.picked:
        set_value(cfg, key, values[key])
