"""Memory plan of an RL (or SFT / RM) run per rank, before any weight is loaded.

Only each model's `config.json` is read: the models are instantiated on PyTorch's `meta` device (shapes without
storage; `meta_models.py`), so parameter counts are exact for any architecture transformers knows, LoRA included,
in well under a second. The per-role byte counts come from `ds_rlhf.engines.memory` (ZeRO formulas, activation
estimate); this module adds what an RL step holds on top of them:

- roles as the trainer builds them: the actor; a critic when the algorithm needs one
  (`ADVANTAGE_ESTIMATORS[algo].meta["critic"]`); a frozen reference when `rl.kl_coef` or `rl.kl_target` > 0; a
  frozen reward model when `reward.model` is set. Frozen roles follow `engines.builder.frozen_config` (ZeRO-1/2
  become a full replica, ZeRO-3 stays partitioned). With `model.share_base` (and LoRA) the reference, the critic
  and a LoRA RM adapter of the actor's base run on the actor's base (`plan_shared.py`): the reference holds
  no weights, the critic and that RM only their adapters and heads, each plus its activations. With
  `model.quantize_base` (nf4 | int8, LoRA) the actor's and a separate critic's frozen base linear weights count at
  bitsandbytes' stored size (`engines.quantized.quantized_weight_bytes`: nf4 ~0.52 byte per parameter with its
  double-quantized scales, int8 1 byte plus an fp32 scale per row) instead of the compute dtype's; embeddings,
  heads, norms and adapters keep theirs. vLLM's copy stays in the rollout dtype (the sync sends the dequantized
  weights);
- activations per micro-batch of `data.micro_batch_tokens` tokens (or `optim.micro_batch_size` x the sequence
  length). The actor's and reference's log-probs use the chunked head (`engines/policy_forward.py`): no
  [tokens x vocab] fp32 logits, only one chunk's (`chunk_size` x vocab) at a time plus three fp32 values per token.
  Frozen roles run without autograd; their forward is estimated as a checkpointed one (an upper bound). At ZeRO-3
  the activations column also holds one gathered layer's full weights plus the prefetch bucket;
- with `rl.distill_loss jsd` the actor's update also holds, per micro-batch, the `[response tokens, vocab]` logits
  of the student (with its graph) and of the teacher in the compute dtype, and DeepSpeed's `generalized_jsd_loss`
  intermediates (`jsd_logits_bytes`), added to the actor's activations. Its response tokens: a fixed-size
  micro-batch's rows x `rollout.max_new_tokens`; under a token budget the whole budget (a micro-batch of short
  prompts is nearly all response);
- the rollout engine: vLLM claims `rollout.gpu_memory_utilization` of the device at start-up for its weights, a
  profiling forward of `VLLM_PROFILE_TOKENS` tokens and the KV cache (the rest); the sidecar's engines (processes
  on the training GPU, never asleep) hold that budget in both phases. Colocated with `rollout.sleep` it
  frees that memory while DeepSpeed trains, so the step has two peaks: rollout (model states + vLLM) and train
  (model states + the largest activations). vLLM's KV cache is the run's own number (`kv_cache.py`): on CPU
  `VLLM_CPU_KVCACHE_SPACE` when set, else `rollout.kv_cache_gb`, else the step's sequences; on GPUs
  `rollout.kv_cache_gb` when set, else what the user's `rollout.gpu_memory_utilization` (or the cap's split)
  leaves, else the sequences the engines hold at once; with a KV cache of a given size each engine holds its
  weights, that cache and `kv_cache.engine_warmup_bytes` (profiling forward or sampler warm-up, CUDA graphs). With
  `rollout.weight_transport shared` the engines hold no weights of their own: one copy, the trainer's buffer they
  read in place, is a row of the trainer's (`shared_weights_row`), resident in both phases.

The settings a plan assumes (the ZeRO stage, offload, optimizer and buckets of the resolved ds_config, the
tokens per micro-batch, the rollout backend) are read as the trainer would read them (`settings.py`).

Between steps DeepSpeed holds the weights and optimizer states (ZeRO-3 also its fp32 gradient partition, so its
gradients are planned at 4 bytes); gradients and ZeRO's gradient-reduction bucket (`reduce_bucket_size`
elements) otherwise exist only while it trains, so they count in the train phase alone.

A run fits when both peaks plus `reserve` (CUDA context, NCCL buffers, allocator slack, what vLLM's sleep keeps)
fit the device. These are estimates: `tests/memory/test_memory_plan.py` checks the model states against a real
AdamW step on CPU; `tests/engines/test_memory.py` checks the activation estimate against autograd. Measured on one
H200 (2026-12-01; torch 2.11, DeepSpeed 0.19.8, bf16, world size 1, a Qwen2-0.5B-shaped model, 4 x 1024 tokens,
one actor step through the chunked head; `max_memory_allocated` of a step after the first, two runs):
ZeRO-2 15.70 / 17.56 GB against 17.31 planned (12.09 / 10.94 GB against 12.42 with gradient checkpointing);
ZeRO-3 17.69 GB against 18.44 (12.22 against 13.55); between steps ZeRO-2 held 6.99 GB against 6.92 planned
(14 bytes per parameter) and ZeRO-3 8.97 GB against 8.89 (18 bytes per parameter).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ds_rlhf.engines import quantized
from ds_rlhf.engines.memory import activation_bytes, precision_bytes
from ds_rlhf.memory import meta_models
from ds_rlhf.memory.kv_cache import engine_warmup_bytes, kv_bytes_per_token, vllm_kv_cache
from ds_rlhf.memory.plan_shared import shared_notes, shared_reward_adapter, shared_roles, shared_row, shares_base
from ds_rlhf.memory.role_plan import RolePlan, Settings, plan_role, quantized_base
from ds_rlhf.memory.settings import resolve_zero, rollout_backend, sequence_tokens
from ds_rlhf.rollout.shared_layout import buffer_numel, model_parameter_shapes

GiB = 1024 ** 3
# fp32 [response tokens, vocab] tensors live at the peak of the JSD path (DeepSpeed's generalized_jsd_loss on both
# models' logits, forward and backward, with the student's log-probs and entropy from the same logits), measured
# with torch.profiler on CPU (tests/memory/test_memory_plan.py re-measures it): 0 < beta < 1 keeps both models'
# fp32 and temperature-scaled logits, log-softmaxes and probabilities, the mixture's log-probs and its two shifted
# inputs and the pointwise terms; beta 0 or 1 (one KL, no mixture) fewer
JSD_FP32_TENSORS = {"mixture": 14, "one_kl": 8}
VLLM_PROFILE_TOKENS = 8192  # vLLM's profiling forward (its max_num_batched_tokens; an assumption, not read from vLLM)
DEFAULT_RESERVE_GB = {"cuda": 2.0, "cpu": 1.0}
ROLES_BY_KIND = {"rl": ("actor", "critic", "reference", "reward"), "sft": ("actor",), "rm": ("reward",)}


@dataclass(frozen=True)
class MemoryPlan:
    settings: Settings
    roles: tuple[RolePlan, ...]
    phases: dict[str, int]  # phase -> device bytes per rank (reserve excluded)
    fits: bool
    host_per_rank: int
    notes: tuple[str, ...] = field(default=())

    @property
    def peak(self) -> int:
        return max(self.phases.values()) if self.phases else 0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for role, plan in zip(out["roles"], self.roles):
            role.update(states=plan.states, device_total=plan.device_total)
        out["peak"] = self.peak
        return out


# ---- per-role bytes ----------------------------------------------------------------------------------------------
def plan_rollout(cfg, hf_config, num_params: int, s: Settings) -> tuple[RolePlan | None, list[str]]:
    """The rollout engine's bytes per GPU (vLLM: its whole budget; HF generate: a model copy and its KV cache),
    and notes on whether its KV cache holds a step's sequences."""
    r = cfg.rollout
    act = precision_bytes(s.rollout_precision)  # the engine's weights and KV cache (rollout.dtype)
    if s.rollout == "none":
        return None, []
    per_token = kv_bytes_per_token(hf_config, act, r.tensor_parallel_size)
    step_seqs = cfg.rl.prompts_per_step * r.n_samples * (s.world_size if r.placement == "disaggregated"
                                                         else r.tensor_parallel_size)
    if s.rollout == "hf":
        batch = min(64, step_seqs)
        return RolePlan("rollout (HF)", num_params, num_params * act, kv_cache=batch * s.seq_len * per_token,
                        detail=f"generate, batches of {batch}"), []
    engines = r.sidecar_engines if r.placement == "sidecar" else 1  # each holds its own weights and profile pass
    engine = vllm_engine_dtype(s)
    act = precision_bytes(engine)
    per_token = kv_bytes_per_token(hf_config, act, r.tensor_parallel_size)
    shared = shares_weights(cfg)  # the engines' weights are views of the trainer's buffer (`shared_weights_row`)
    weights = 0 if shared else engines * num_params * act // r.tensor_parallel_size
    copies = "weights in the trainer's shared buffer" if shared else "a weight copy each"
    profile = activation_bytes(hf_config, VLLM_PROFILE_TOKENS, act, gradient_checkpointing=True,
                               lm_head=False) // r.tensor_parallel_size
    overhead = engines * profile
    # on GPUs what each engine takes beside weights and a KV cache of a given size (CPU: the profiling forward)
    warmup = engines * engine_warmup_bytes(profile, hf_config.vocab_size, r.max_num_seqs) if s.device == "cuda" \
        else overhead
    size = vllm_kv_cache(cfg, hf_config, device=s.device, host_bytes=s.capacity, world_size=s.world_size,
                         engine_bytes=weights + warmup)
    if size.bytes:
        kv, detail, overhead = size.bytes, f"KV cache {size.detail}", warmup
    else:
        kv = int(r.gpu_memory_utilization * s.capacity) - weights - overhead
        detail = f"gpu_memory_utilization {r.gpu_memory_utilization}"
        if engines > 1:
            detail += f" over {engines} sidecar engines ({copies})"
    notes = []
    knob = "rollout.kv_cache_gb" if size.bytes else "rollout.gpu_memory_utilization"
    seqs = max(kv, 0) // max(per_token * s.seq_len, 1)
    if kv <= 0:
        notes.append(f"FAIL: vLLM's budget (rollout.gpu_memory_utilization={r.gpu_memory_utilization} of "
                     f"{fmt_bytes(s.capacity)}) does not hold its weights ({fmt_bytes(weights)}) and profiling "
                     f"forward ({fmt_bytes(overhead)}): raise it or use tensor parallelism"
                     + (f", or fewer rollout.sidecar_engines ({engines}: {copies})" if engines > 1 else ""))
    elif seqs < 1:
        notes.append(f"FAIL: vLLM's KV cache ({fmt_bytes(kv)}) holds no full {s.seq_len}-token sequence: vLLM "
                     f"refuses to start; raise {knob} or lower rollout.max_model_len")
    elif seqs < step_seqs:
        notes.append(f"vLLM's KV cache holds {seqs} full-length sequences of the step's {step_seqs}: it generates "
                     f"in waves (slower rollouts); raise {knob} for one wave")
    detail += f", {engine} KV {per_token} B/token: {seqs} sequences of {s.seq_len} (step: {step_seqs})"
    return RolePlan("vllm", num_params, weights, activations=overhead, kv_cache=max(kv, 0), detail=detail), notes


def vllm_engine_dtype(s: Settings) -> str:
    """The vLLM engines' weights and KV cache dtype: the rollout dtype; fp32 on CPU, where vLLM-CPU runs float32
    here (rollout/vllm_adapter.py)."""
    return "fp32" if s.device == "cpu" else s.rollout_precision


def shares_weights(cfg) -> bool:
    """`rollout.weight_transport shared` on sidecar engines: one weight copy, the trainer's, for all of them."""
    return cfg.rollout.weight_transport == "shared" and cfg.rollout.placement == "sidecar"


def shared_weights_row(cfg, hf_config, s: Settings) -> RolePlan | None:
    """`rollout.weight_transport shared`: the one buffer every sidecar engine's weights are views of, allocated by
    the trainer's process (`rollout/server/shared.py`) and so planned beside its model states, in both phases. Its
    size is the trainer's: `shared_layout.buffer_numel` over the model's parameters (meta device, tied ones once,
    each aligned, vocabularies padded as vLLM pads them; `shared_layout.model_parameter_shapes`, as the trainer reads
    them) in the engines' dtype (`vllm_engine_dtype`). None otherwise."""
    if not shares_weights(cfg) or s.rollout != "vllm":
        return None
    shapes, vocab = model_parameter_shapes(meta_models.meta_model("actor", hf_config))
    size = precision_bytes(vllm_engine_dtype(s))
    engines = cfg.rollout.sidecar_engines
    return RolePlan("shared weights", sum(math.prod(shape) for _, shape in shapes),
                    buffer_numel(shapes, size, vocab) * size,
                    detail=f"one copy the {engines} sidecar engine{'s' if engines > 1 else ''} read in place "
                           "(rollout.weight_transport shared)")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def jsd_response_tokens(cfg, tokens: int) -> int:
    """Response tokens of one micro-batch of `tokens` tokens (`settings.sequence_tokens`), at most:
    `optim.micro_batch_size` rows x `rollout.max_new_tokens` (within those tokens), or under
    `data.micro_batch_tokens` the whole budget."""
    if cfg.data.micro_batch_tokens > 0:
        return tokens
    return min(tokens, max(1, cfg.optim.micro_batch_size) * cfg.rollout.max_new_tokens)


def jsd_logits_bytes(cfg, hf_config, s: Settings) -> int:
    """`rl.distill_loss jsd`: the bytes the actor's update holds per micro-batch for the full-distribution loss:
    both models' `[N, vocab]` logits in the compute dtype and `JSD_FP32_TENSORS` fp32 tensors of that shape, N the
    micro-batch's response tokens (`jsd_response_tokens`). 0 without the JSD loss."""
    if cfg.rl.distill_loss != "jsd":
        return 0
    return jsd_response_tokens(cfg, s.tokens) * jsd_bytes_per_token(hf_config.vocab_size, s.precision, cfg.rl.jsd_beta)


def jsd_bytes_per_token(vocab: int, precision: str, beta: float) -> int:
    """Bytes of the JSD path per response token: both models' logits in the compute dtype (`precision`) and
    `JSD_FP32_TENSORS` fp32 rows of `vocab` values (14 for a mixture, 0 < beta < 1; 8 at beta 0 or 1)."""
    act = precision_bytes(precision)
    return vocab * (2 * act + 4 * JSD_FP32_TENSORS["mixture" if 0 < beta < 1 else "one_kl"])


# ---- the plan ----------------------------------------------------------------------------------------------------
def plan_phases(roles: list[RolePlan], rollout: RolePlan | None, s: Settings) -> tuple[dict[str, int], int]:
    """Device bytes per rank in the rollout and train phases, and host bytes per rank."""
    trained = [r for r in roles if r.role != "vllm" and not r.role.startswith("rollout")]
    resident = sum(r.resident for r in trained)  # ZeRO-0/1/2 free the gradients after step(); ZeRO-3 keeps them
    acts = max((r.activations for r in trained), default=0) + sum(r.states + r.buffers - r.resident for r in trained)
    host = sum(r.host for r in trained)
    # the sidecar's vLLM processes share the training GPU and stay awake: their budget counts in both phases
    colocated = rollout is not None and (s.placement in ("colocated", "sidecar") or s.device == "cpu")
    engine = 0
    if colocated and rollout.role == "vllm":
        engine = rollout.params + rollout.activations + rollout.kv_cache  # the budget vLLM claims at start-up
    elif colocated:
        engine = rollout.device_total
    asleep = colocated and s.sleep and s.device == "cuda" and rollout.role == "vllm" and s.placement == "colocated"
    if asleep and s.sleep_level == 1:
        host += rollout.params  # level 1 keeps a host copy of vLLM's weights while it sleeps
    phases = {"rollout": resident + engine, "train": resident + acts + (0 if asleep else engine)}
    return phases, host


def plan_memory(cfg, *, kind: str = "rl", device: str, capacity: int, device_name: str = "", world_size: int = 1,
                reserve: int | None = None) -> MemoryPlan:
    """The plan for `cfg` on `world_size` ranks of `capacity` bytes each (no weights are loaded)."""
    precision = cfg.model.planned_precision(device)
    zero = resolve_zero(cfg, precision, world_size)
    tokens, length = sequence_tokens(cfg, kind)
    backend = rollout_backend(cfg, device) if kind == "rl" else "none"
    s = Settings(kind, device, device_name, capacity,
                 int(DEFAULT_RESERVE_GB[device] * GiB) if reserve is None else reserve, world_size, precision,
                 cfg.rollout.engine_precision(precision),
                 zero["stage"], zero["offload_optimizer"], zero["offload_param"], zero["optimizer"], tokens, length,
                 cfg.model.gradient_checkpointing, backend, cfg.rollout.placement, cfg.rollout.sleep,
                 cfg.rollout.sleep_level, zero["prefetch"], zero["reduce_bucket"])
    notes = [] if zero["optimizer_type"] in ("adam", "adamw", "onebitadam") else [
        f"optimizer {zero['optimizer_type']}: planned with Adam-sized states (two fp32 values per parameter)"]
    sources = meta_models.role_sources(cfg, kind)
    shared = shared_roles(cfg, kind, sources, zero["stage"])  # roles on the actor's base (plan_shared.py)
    configs = {role: meta_models.hf_config(cfg.model.path if role in shared else path)
               for role, path in sources.items()}
    lora = meta_models.lora_settings(cfg)
    rm_adapter = shared_reward_adapter(cfg, s.zero_stage) if "reward" in shared else None
    roles = []
    for role, hf in configs.items():
        if role in shared:
            roles.append(shared_row(role, hf, s, lora=lora, rm_path=rm_adapter,
                                    frozen_stage=zero["frozen_stage"], frozen_offload=zero["frozen_offload"],
                                    detail=shared[role]))
        else:
            # the reward model trains with LoRA in an RM run only; in RL it is a frozen, already trained model
            module = meta_models.meta_model(role, hf, lora if role != "reward" or kind == "rm" else None)
            plan = plan_role(role, module, hf, s, zero["frozen_stage"], zero["frozen_offload"])
            if lora and role in ("actor", "critic") and quantized.enabled(cfg.model.quantize_base):
                plan = quantized_base(plan, module, s, cfg.model.quantize_base)
            roles.append(plan)
    notes += shared_notes(cfg, shared, s.zero_stage)
    if kind == "rl" and (jsd := jsd_logits_bytes(cfg, configs["actor"], s)):
        actor = roles[0]
        roles[0] = dataclasses.replace(actor, activations=actor.activations + jsd,
                                       detail=f"{actor.detail}, JSD logits {fmt_bytes(jsd)}")
    rollout = None
    if kind == "rl":
        rollout, more = plan_rollout(cfg, configs["actor"], roles[0].num_params, s)
        notes += more
        roles += [row for row in (shared_weights_row(cfg, configs["actor"], s), rollout) if row is not None]
    phases, host = plan_phases(roles, rollout, s)
    fits = max(phases.values()) + s.reserve <= capacity and not any(n.startswith("FAIL") for n in notes)
    if not fits:
        notes += remedies(cfg, roles, rollout, phases, s)
    if quantized.enabled(cfg.model.quantize_base) and s.zero_stage == 3:
        notes.append(f"FAIL: model.quantize_base={cfg.model.quantize_base} needs ZeRO stage 0, 1 or 2 (this plan is "
                     "ZeRO-3): set --zero_stage 2")
        fits = False
    if s.precision == "fp16" and device == "cpu":
        notes.append("FAIL: model.dtype=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16)")
        fits = False
    return MemoryPlan(s, tuple(roles), phases, fits, host, tuple(notes))


def remedies(cfg, roles: list[RolePlan], rollout: RolePlan | None, phases: dict[str, int], s: Settings) -> list[str]:
    """What would make an over-budget plan fit, phase by phase (first-order: one setting at a time)."""
    out = []
    free = s.capacity - s.reserve
    trained = [r for r in roles if r is not rollout]
    # ZeRO-3 is refused with a quantized base, and with a critic on the shared base
    zero3 = not (quantized.enabled(cfg.model.quantize_base) or (shares_base(cfg) and any(
        r.role == "critic" for r in trained)))
    resident = sum(r.resident for r in trained)
    if phases["rollout"] > free and rollout is not None and rollout.role == "vllm" and s.placement == "colocated":
        util = (free - resident) / s.capacity
        need = (rollout.params + rollout.activations) / s.capacity
        if util > need:
            out.append(f"rollout.gpu_memory_utilization <= {util:.2f} fits (now {cfg.rollout.gpu_memory_utilization})")
        else:
            out.append(f"the model states alone ({fmt_bytes(resident)}) leave vLLM too little: "
                       + ("ZeRO-3 (--zero_stage 3), " if zero3 else "") + "--offload true, or "
                       "rollout.placement=disaggregated")
    if phases["train"] > free:
        acts = max(r.activations for r in trained)
        if not s.gradient_checkpointing and acts > 0.2 * phases["train"]:
            out.append(f"activations are {fmt_bytes(acts)}: --model.gradient_checkpointing true")
        if s.tokens > s.seq_len:
            out.append(f"a smaller micro-batch (data.micro_batch_tokens / optim.micro_batch_size; now {s.tokens} "
                       "tokens) lowers the activations")
        if s.zero_stage < 3 and s.world_size > 1 and zero3:
            out.append("ZeRO-3 (--zero_stage 3) partitions the weights over the ranks")
    return out + low_memory_remedies(cfg, trained, s)


def low_memory_remedies(cfg, trained: list[RolePlan], s: Settings) -> list[str]:
    """The low-memory switches (`ds_configs/low_memory_24g.yaml`) that would shrink this plan, with the bytes each
    saves by the plan's own numbers (first-order: one at a time)."""
    out = []
    by_role = {r.role: r for r in trained}
    ref = by_role.get("reference")
    if ref is not None and ref.params + ref.host > 0 and s.kind == "rl":
        saved = fmt_bytes(ref.params) + (f" on the GPU, {fmt_bytes(ref.host)} on the host" if ref.host else "")
        out.append(f"--model.share_base true (with LoRA) drops the reference copy ({saved})"
                   if cfg.model.lora_rank > 0 else
                   f"--model.lora_rank 16 --model.share_base true drops the reference copy ({saved}) and trains "
                   "adapters only")
    learners = [by_role[r] for r in ("actor", "critic") if r in by_role]
    if cfg.model.lora_rank <= 0 and learners:
        saved = sum(r.grads + r.optimizer_states for r in learners)
        out.append(f"--model.lora_rank 16 trains adapters only (gradients and optimizer states: {fmt_bytes(saved)})")
    on_device = sum(r.optimizer_states for r in learners)
    if not s.offload_optimizer and on_device > 0.1 * sum(r.states for r in learners):
        out.append(f"--offload true moves the optimizer states ({fmt_bytes(on_device)}) to host memory")
    if "critic" in by_role:
        out.append(f"a critic-free algorithm (--rl.algo grpo) drops the critic ({fmt_bytes(by_role['critic'].states)})")
    return out
