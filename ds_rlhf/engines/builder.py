"""Turn a model role into a DeepSpeed engine from a resolved ds_config.

Trainable roles (actor, critic) get ``deepspeed.initialize`` with the config's optimizer (DeepSpeed's own, or our
``OneBitAdam`` for ``"type": "OneBitAdam"``) and scheduler; parameters are split into decay / no-decay groups
(biases and norm weights get no weight decay, as in Hugging Face's Trainer). On the CPU accelerator with ZeRO
optimizer offload, an Adam/AdamW config gets torch's ``Adam``/``AdamW`` (``cpu_offload_adam``) in place of
DeepSpeed's ``DeepSpeedCPUAdam``: the same update, without the ~2 min C++ JIT build of ``cpu_adam`` that a fresh
checkout would pay on CPU. GPUs keep DeepSpeedCPUAdam.

Frozen roles (reference, reward) are DeepSpeed engines too, without optimizer or scheduler, so they share the
actor's precision handling and ZeRO-3 partitioning:

- ZeRO stage 3 stays stage 3 (ZeRO-Inference: weights partitioned, gathered layer by layer in forward), with
  ``offload=True`` adding ``offload_param: cpu`` for models that do not fit beside the actor;
- stages 1/2 become stage 0 (they only partition optimizer state and gradients, which a frozen model has none of),
  i.e. a full replica on the device in the run's precision.

With ``model.share_base`` (LoRA) the reference is no engine at all: ``build_shared_reference`` returns a view of the
actor with its adapters disabled (``shared_base.AdapterOffReference``), so the base weights exist once. The critic
(``shared_critic.build_shared_critic``) and, when the RM is a LoRA adapter of the actor's base, the reward model
(``shared_reward.build_shared_reward``) are engines of their own over module trees that hold the actor's base
tensors plus their own adapters and head (ZeRO 0-2 only).

Trainable models are loaded in fp32 so DeepSpeed's fp32 master weights are exact; frozen ones and a LoRA model's frozen
base in the compute dtype (`load_dtypes`). At ZeRO-3 the module is partitioned one parameter at a time before
`deepspeed.initialize` (`partition_zero3`), so a model whose weights are offloaded never sits whole on the GPU.
"""

from __future__ import annotations

import copy
import logging

import torch

from ds_rlhf.distributed import ensure_distributed
from ds_rlhf.engines import quantized
from ds_rlhf.engines.ds_config import check_optimizer_compat, config_precision, find_auto, log_resolved_config
from ds_rlhf.engines.models import CriticModel, RewardModel, as_dtype, load_causal_lm
from ds_rlhf.engines.onebit_adam import OneBitAdam, onebit_from_config
from ds_rlhf.engines.roles import RoleInfo, register_role
from ds_rlhf.engines.shared_base import AdapterOffReference

__all__ = ["build_actor", "build_critic", "build_engine", "build_reference", "build_reward", "build_shared_reference",
           "ensure_distributed"]

logger = logging.getLogger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into weight-decay and no-decay (bias, norms, other 1-D tensors) groups."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


# Optimizer params whose torch meaning is DeepSpeed's; a config with any other key keeps DeepSpeed's optimizer.
_TORCH_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}


def cpu_offload_adam(cfg: dict, groups: list[dict]) -> torch.optim.Optimizer | None:
    """torch's Adam/AdamW for an Adam/AdamW ``cfg`` with ZeRO optimizer offload on the CPU accelerator, else None.

    DeepSpeed would build ``DeepSpeedCPUAdam`` there, a C++ op JIT-compiled on first use (~2 min on two cores, paid
    by every fresh checkout and CI run). On CPU that op buys nothing over torch's implementation of the same update,
    so we pass torch's as the client optimizer. The mode follows DeepSpeed's mapping (``_configure_basic_optimizer``):
    "AdamW", or "Adam" with ``adam_w_mode`` (default true), is decoupled weight decay (``torch.optim.AdamW``);
    "Adam" with ``adam_w_mode: false`` is L2 decay added to the gradient (``torch.optim.Adam``). Defaults are
    DeepSpeedCPUAdam's (torch's AdamW would default weight_decay to 0.01)."""
    from deepspeed.accelerator import get_accelerator

    opt_cfg = cfg.get("optimizer") or {}
    params = opt_cfg.get("params", {})
    offload = (cfg.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device")
    if (get_accelerator().device_name() != "cpu" or offload != "cpu"
            or str(opt_cfg.get("type", "")).lower() not in ("adam", "adamw")):
        return None
    if set(params) - _TORCH_ADAM_KEYS or not params.get("bias_correction", True):
        logger.info("optimizer params %s have no torch Adam equivalent: keeping DeepSpeed's CPU Adam", sorted(params))
        return None
    adamw = str(opt_cfg["type"]).lower() == "adamw" or params.get("adam_w_mode", True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return cls(groups, lr=params.get("lr", 1e-3), betas=tuple(params.get("betas", (0.9, 0.999))),
               eps=params.get("eps", 1e-8), weight_decay=params.get("weight_decay", 0.0))


def frozen_config(ds_config: dict, offload: bool | None = None) -> dict:
    """The inference variant of a training config (see module docstring)."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    zero = cfg.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    zero.pop("zero_quantized_gradients", None)
    if offload:
        zero["stage"] = 3
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif zero.get("stage", 0) in (1, 2):
        cfg["zero_optimization"] = {"stage": 0}
    if zero.get("stage", 0) != 3:
        zero.pop("offload_param", None)
    return cfg


def build_engine(model: torch.nn.Module, ds_config: dict, *, role: str, trainable: bool = True):
    """A DeepSpeed engine for ``model``; ``ds_config`` must be resolved (no "auto"). Returns the engine; its
    optimizer/scheduler are ``engine.optimizer``/``engine.lr_scheduler``."""
    import deepspeed

    left = find_auto(ds_config)
    if left:
        raise ValueError(f"build_engine({role}) needs a resolved ds_config; still 'auto': {', '.join(left)} "
                         "(call ds_config.resolve_ds_config first)")
    ensure_distributed()
    cfg = copy.deepcopy(ds_config)
    client_opt, groups = None, None
    if trainable:
        check_optimizer_compat(cfg)
        opt_cfg = cfg.get("optimizer")
        if not opt_cfg:
            raise ValueError(f"trainable role {role!r} needs an 'optimizer' section in its ds_config")
        groups = param_groups(model, opt_cfg.get("params", {}).get("weight_decay", 0.0))
        if not groups:
            raise ValueError(f"trainable role {role!r} has no parameters with requires_grad=True")
        init_cfg = cfg
        if opt_cfg.get("type") == "OneBitAdam":
            client_opt = onebit_from_config(opt_cfg, groups)
            init_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        elif (client_opt := cpu_offload_adam(cfg, groups)) is not None:
            # DeepSpeed refuses a client optimizer under ZeRO-Offload unless told it is deliberate; its scheduler
            # section still applies (DeepSpeed wraps the client optimizer with it).
            init_cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
            init_cfg["zero_force_ds_cpu_optimizer"] = False
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        cfg = init_cfg = frozen_config(cfg)
    log_resolved_config(cfg)
    partition_zero3(model, init_cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=client_opt, config=init_cfg)
    if isinstance(client_opt, OneBitAdam):
        client_opt.bind_engine(engine)
    if not trainable:
        engine.eval()
    register_role(engine, RoleInfo(role=role, ds_config=cfg, trainable=trainable))
    logger.info("built %s engine: ZeRO-%s, %s, optimizer %s", role, cfg.get("zero_optimization", {}).get("stage", 0),
                config_precision(cfg), type(engine.optimizer).__name__ if engine.optimizer is not None else None)
    return engine


def partition_zero3(model: torch.nn.Module, ds_config: dict) -> None:
    """ZeRO-3: partition `model` one parameter at a time before `deepspeed.initialize`, which otherwise moves a
    module not built under `deepspeed.zero.Init` to the accelerator whole first (`_configure_distributed_model`),
    then partitions it: a 15 GiB transient for an 8B model even with its weights offloaded (measured on the H200,
    bench/low_memory_gpu.py). Here each parameter is cast to the compute dtype on the host (DeepSpeed's own cast,
    buffers left to it), visits the accelerator alone and leaves its shard on the offload device
    (`deepspeed.zero.Init(module=...)`, the call DeepSpeed itself makes after the move); buffers then go to the
    accelerator, where DeepSpeed's move would have put them. A no-op below ZeRO-3 or for a module already
    partitioned."""
    zero = ds_config.get("zero_optimization", {})
    own = (zero.get("zero_hpz_partition_size", 1) or 1) > 1 or (zero.get("mics_shard_size", -1) or -1) > 0 or \
        zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights")
    if zero.get("stage") != 3 or own:
        return  # hpZ / MiCS / quantized weights: DeepSpeed's own path, with the groups it builds for them
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import CASTABLE_DTYPES

    precision = config_precision(ds_config)
    dtype = as_dtype(precision)
    if precision != "fp32":  # fp32 runs: DeepSpeed casts nothing either
        for p in model.parameters():  # the cast of DeepSpeedEngine._cast_module_mixed_precision, same dtypes
            if p.dtype in CASTABLE_DTYPES and p.dtype != dtype:
                p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, dtype=dtype)
    device = torch.device(get_accelerator().current_device_name())
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def load_dtypes(ds_config: dict, trainable: bool, *, lora: dict | None = None, quantize: str | None = None) -> dict:
    """`dtype` / `compute_dtype` to load a role's model in. Trainable models load in fp32 (DeepSpeed's fp32 master
    weights are then exact); frozen ones, and a LoRA model's frozen base (not quantized), in the compute dtype:
    DeepSpeed casts every parameter to it anyway and peft casts the fp32-initialised adapters to their base's dtype,
    so the engine starts from the same values, and an 8B LoRA base takes 16 GB of host memory instead of 32."""
    compute = config_precision(ds_config)
    frozen_base = bool(lora) and not quantized.enabled(quantize)
    return {"dtype": "fp32" if trainable and not frozen_base else compute, "compute_dtype": compute}


def build_actor(model_path, ds_config: dict, *, attn_impl: str = "auto", gradient_checkpointing: bool = False,
                lora: dict | None = None, quantize: str | None = None, kernels: str = "none"):
    """`quantize` (model.quantize_base, with `lora`): the frozen base's linear layers stored by bitsandbytes;
    `kernels`: model.kernels (engines/kernels.py)."""
    quantized.check_ds_config(quantize, ds_config)  # before loading: ZeRO-3 cannot partition packed weights
    model = load_causal_lm(model_path, attn_impl=attn_impl, gradient_checkpointing=gradient_checkpointing,
                           lora=lora, quantize=quantize, kernels=kernels,
                           **load_dtypes(ds_config, True, lora=lora, quantize=quantize))
    return build_engine(model, ds_config, role="actor", trainable=True)


def build_critic(model_path, ds_config: dict, *, init_from: str = "reward", attn_impl: str = "auto",
                 gradient_checkpointing: bool = False, lora: dict | None = None, quantize: str | None = None,
                 kernels: str = "none"):
    quantized.check_ds_config(quantize, ds_config)
    model = CriticModel.from_pretrained(model_path, init_from, attn_impl=attn_impl, lora=lora, quantize=quantize,
                                        kernels=kernels,
                                        gradient_checkpointing=gradient_checkpointing,
                                        **load_dtypes(ds_config, True, lora=lora, quantize=quantize))
    return build_engine(model, ds_config, role="critic", trainable=True)


def build_reference(model_path, ds_config: dict, *, attn_impl: str = "auto", offload: bool | None = None,
                    kernels: str = "none"):
    model = load_causal_lm(model_path, attn_impl=attn_impl, kernels=kernels, **load_dtypes(ds_config, False))
    return build_engine(model, frozen_config(ds_config, offload), role="reference", trainable=False)


def build_shared_reference(actor):
    """The reference of `model.share_base`: the actor's module with its LoRA adapters disabled (no second copy)."""
    reference = AdapterOffReference(actor)
    logger.info("reference: the actor's base model with its LoRA adapters disabled (model.share_base)")
    return reference


def build_reward(model_path, ds_config: dict, *, attn_impl: str = "auto", offload: bool | None = None,
                 kernels: str = "none"):
    model = RewardModel.from_pretrained(model_path, attn_impl=attn_impl, kernels=kernels,
                                        **load_dtypes(ds_config, False))
    return build_engine(model, frozen_config(ds_config, offload), role="reward", trainable=False)
