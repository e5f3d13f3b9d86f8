"""One role's memory plan row (`plan_role`: model states by ZeRO stage and offload, activations per micro-batch)
and the settings a plan assumes (`Settings`); `plan.py` puts the rows of a run together."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from ds_rlhf.engines import quantized
from ds_rlhf.engines.memory import activation_bytes, memory_breakdown, precision_bytes
from ds_rlhf.engines.policy_forward import sequence_logprobs

GiB = 1024 ** 3


@dataclass(frozen=True)
class RolePlan:
    """Bytes per rank of one role on its device (`host`: what sits in host memory instead)."""

    role: str
    num_params: int
    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    activations: int = 0
    kv_cache: int = 0
    host: int = 0
    detail: str = ""
    buffers: int = 0  # ZeRO's gradient-reduction bucket (train phase only)
    resident_grads: bool = False  # ZeRO-3 keeps its fp32 gradient partition between steps

    @property
    def resident(self) -> int:
        """Bytes held between steps (the rollout phase)."""
        return self.params + self.optimizer_states + (self.grads if self.resident_grads else 0)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def device_total(self) -> int:
        return self.states + self.activations + self.kv_cache + self.buffers


@dataclass(frozen=True)
class Settings:
    """What a plan assumed (all read from the config, the ds_config and the command line)."""

    kind: str
    device: str  # cuda | cpu
    device_name: str
    capacity: int  # bytes per rank
    reserve: int
    world_size: int
    precision: str  # the trainer's
    rollout_precision: str  # the rollout engines' (rollout.dtype; auto: the trainer's)
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    optimizer: str
    tokens: int  # per micro-batch
    seq_len: int
    gradient_checkpointing: bool
    rollout: str  # vllm | hf | none
    placement: str
    sleep: bool
    sleep_level: int = 2
    zero3_prefetch: int = 0  # elements: ZeRO-3's prefetch bucket (stage3_prefetch_bucket_size)
    reduce_bucket: int = 0  # elements: ZeRO's gradient-reduction bucket (reduce_bucket_size)


def logprob_head_bytes(hf_config, tokens: int, act_bytes: int, *, training: bool) -> int:
    """The chunked log-prob head: per-token fp32 logp / logsumexp / entropy, and one chunk's logits (in the
    compute dtype, then fp32) plus, when training, the fp32 probabilities for the entropy and the backward."""
    chunk = min(tokens, inspect.signature(sequence_logprobs).parameters["chunk_size"].default)
    per_chunk_token = hf_config.vocab_size * (act_bytes + 4 + (4 if training else 0))
    return tokens * 12 + chunk * per_chunk_token


def _states(module, s: Settings, *, trainable: bool, stage: int, offload_param: bool) -> dict:
    """`memory_breakdown` with the ds_config's placement: offloaded optimizer state and, at ZeRO-3 only when
    `offload_param`, offloaded weights."""
    optimizer = s.optimizer if trainable else "none"
    offload = (s.offload_optimizer and trainable) or offload_param
    b = memory_breakdown(module, zero_stage=stage, world_size=s.world_size, optimizer=optimizer,
                         offload=offload and stage > 0, precision=s.precision,
                         gradient_checkpointing=s.gradient_checkpointing, trainable=trainable)
    params_on_host = offload and stage == 3 and offload_param
    opt_on_host = offload and stage > 0 and trainable and s.offload_optimizer
    host = (b["params"] if params_on_host else 0) + (b["optimizer_states"] if opt_on_host else 0)
    return {"num_params": b["num_params"], "params": 0 if params_on_host else b["params"], "grads": b["grads"],
            "optimizer_states": 0 if opt_on_host else b["optimizer_states"], "host": host,
            "num_trainable": b["num_trainable"]}


def plan_role(role: str, module, hf_config, s: Settings, frozen_stage: int, frozen_offload: bool) -> RolePlan:
    trainable = role in ("actor", "critic") or (s.kind == "rm" and role == "reward")
    stage = s.zero_stage if trainable else frozen_stage
    b = _states(module, s, trainable=trainable, stage=stage, offload_param=(s.offload_param if trainable
                                                                           else frozen_offload))
    act = precision_bytes(s.precision)
    tokens = s.tokens
    if trainable:
        acts = activation_bytes(hf_config, tokens, act, gradient_checkpointing=s.gradient_checkpointing,
                                lm_head=False)
    else:  # no autograd: estimated as a checkpointed forward (keeps at most one layer's intermediates)
        acts = activation_bytes(hf_config, tokens, act, gradient_checkpointing=True, lm_head=False)
    if role in ("actor", "reference"):
        acts += logprob_head_bytes(hf_config, tokens, act, training=trainable)
    if stage == 3:  # forward/backward gather one layer's full weights, plus the prefetch bucket
        acts += (b["num_params"] // hf_config.num_hidden_layers + s.zero3_prefetch) * act
    buffers = s.reduce_bucket * act if trainable and stage > 0 else 0
    grads = b["grads"] * (2 if stage == 3 and act == 2 else 1)  # ZeRO-3: a persistent fp32 gradient partition
    lora = f", {b['num_trainable'] / 1e6:.2f}M trainable" if trainable and b["num_trainable"] < b["num_params"] else ""
    detail = (f"ZeRO-{stage}, {'trained' if trainable else 'frozen'}{lora}"
              + (", optimizer on host" if trainable and s.offload_optimizer else "")
              + (", weights on host" if b["params"] == 0 and b["num_params"] else ""))
    return RolePlan(role, b["num_params"], b["params"], grads, b["optimizer_states"], acts, 0, b["host"], detail,
                    buffers, resident_grads=stage == 3 and trainable)


def quantized_base(plan: RolePlan, module, s: Settings, mode: str) -> RolePlan:
    """`plan` with the frozen base linear weights at their quantized size (`model.quantize_base`); ZeRO-0/1/2 keep
    them whole on the device (the schema refuses ZeRO-3 with a quantized base)."""
    act = precision_bytes(s.precision)
    numel, saved = quantized.base_bytes_saved(module, mode, act)
    if not numel or plan.params == 0:
        return plan
    return dataclasses.replace(plan, params=plan.params - saved,
                               detail=f"{plan.detail}, base {mode} ({numel / 1e6:.2f}M weights quantized)")
