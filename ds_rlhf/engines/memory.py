"""Per-role memory accounting (bytes per rank), for planning and for the memory profiler.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3): with N parameters of which N_t trainable,
mixed precision (bf16/fp16) holds 2N bytes of weights, 2N_t of gradients and 12N_t of optimizer state (fp32
master + Adam m and v); fp32 training holds 4N, 4N_t and 8N_t. ZeRO-1 divides the optimizer state by the
data-parallel size W, ZeRO-2 also the gradients, ZeRO-3 also the weights. Offload moves the optimizer state (and at
ZeRO-3 the weights) to host memory. 1-bit Adam adds its error buffers: 4N_t (worker) + 4N_t/W (server).

Activations are an estimate for a Llama/Qwen2-style decoder with a memory-efficient attention kernel (no T x T
scores kept): per token and layer the tensors saved for backward are about 8h + 2k + 4f elements (h hidden, k the
K/V width, f the MLP width: norm inputs, q/k/v/attention outputs, MLP inputs, gate/up/activation outputs). With
(per-layer) gradient checkpointing only each layer's input (h) is kept, plus one layer's full set while it is
recomputed. The LM head adds logits in the compute dtype plus an fp32 copy for the loss (``vocab * (a + 4)``).
``tests/engines/test_memory.py`` checks the estimate against the bytes autograd actually saves on the tiny model.
"""

from __future__ import annotations

from ds_rlhf.engines.ds_config import config_precision
from ds_rlhf.engines.roles import role_info

OPTIMIZERS = ("adam", "adamw", "onebit_adam", "none")


def precision_bytes(precision: str) -> int:
    """Bytes per value in `precision`: 2 for bf16 / fp16, 4 for fp32."""
    return 2 if precision in ("bf16", "fp16") else 4


def _module(model_or_engine):
    return getattr(model_or_engine, "module", model_or_engine)


def count_params(module) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned parameters report their full size (``ds_numel``)."""
    total = trainable = 0
    seen = set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _config_of(module):
    config = getattr(module, "config", None)
    inner = getattr(module, "get_base_model", None)
    if config is None and callable(inner):
        config = getattr(inner(), "config", None)
    return config


def activation_bytes(config, tokens: int, act_bytes: int, *, gradient_checkpointing: bool,
                     lm_head: bool = True) -> int:
    """Estimated activation memory for ``tokens`` tokens in one micro-batch (see module docstring)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads) * head_dim
    ffn = getattr(config, "intermediate_size", 4 * h)
    per_layer = 8 * h + 2 * kv + 4 * ffn
    if gradient_checkpointing:
        body = tokens * (layers * h + per_layer) * act_bytes
    else:
        body = tokens * layers * per_layer * act_bytes
    head = tokens * config.vocab_size * (act_bytes + 4) if lm_head else tokens * 4
    return int(body + tokens * h * act_bytes + head)


def memory_breakdown(model_or_engine, *, zero_stage: int, world_size: int, optimizer: str = "adam",
                     micro_batch_tokens: int = 0, offload: bool = False, precision: str | None = None,
                     gradient_checkpointing: bool | None = None, trainable: bool | None = None) -> dict:
    """Bytes per rank by category: ``params``, ``grads``, ``optimizer_states``, ``activations``, plus
    ``device_total`` and ``host_total`` (offloaded state), the counts used and the precision.

    ``precision`` defaults to the engine's ds_config ("fp32" for plain modules); ``gradient_checkpointing`` to the
    model's flag; ``trainable`` to whether any parameter requires grad.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    module = _module(model_or_engine)
    if precision is None:
        precision = _engine_precision(model_or_engine)
    total, n_train = count_params(module)
    if trainable is False:
        n_train = 0
    wbytes = precision_bytes(precision)
    w = max(1, world_size)
    params, grads, opt = _model_states(total, n_train, wbytes, w, zero_stage, optimizer)
    params_device, opt_device, host = _placed(params, opt, zero_stage, offload)
    if gradient_checkpointing is None:
        gradient_checkpointing = _checkpointing_flag(module)
    acts = _activations(module, micro_batch_tokens, wbytes, n_train, gradient_checkpointing)
    return {
        "params": params, "grads": grads, "optimizer_states": opt, "activations": acts,
        "device_total": params_device + grads + opt_device + acts, "host_total": host,
        "num_params": total, "num_trainable": n_train, "precision": precision, "zero_stage": zero_stage,
        "world_size": w, "offload": offload, "gradient_checkpointing": gradient_checkpointing,
    }


def _engine_precision(model_or_engine) -> str:
    """The precision of an engine's ds_config (its registered role), "fp32" for a plain module."""
    info = role_info(model_or_engine)
    return config_precision(info.ds_config) if info else "fp32"


def _model_states(total: int, n_train: int, wbytes: int, w: int, zero_stage: int,
                  optimizer: str) -> tuple[int, int, int]:
    """(params, grads, optimizer_states) bytes per rank: weights and gradients at ``wbytes`` per element, Adam's
    fp32 state (plus the fp32 master with mixed precision, 1-bit Adam's error buffers), divided over ``w`` ranks
    as the ZeRO stage partitions them."""
    params = total * wbytes
    grads = n_train * wbytes
    opt = 0
    if optimizer != "none":
        opt = n_train * (12 if wbytes == 2 else 8)
        if optimizer == "onebit_adam":
            opt += n_train * 4 + n_train * 4 // w
    if zero_stage >= 1:
        opt //= w
    if zero_stage >= 2:
        grads //= w
    if zero_stage == 3:
        params //= w
    return params, grads, opt


def _placed(params: int, opt: int, zero_stage: int, offload: bool) -> tuple[int, int, int]:
    """(params on the device, optimizer state on the device, host bytes): offload moves the optimizer state, and at
    ZeRO-3 the weights, to host memory."""
    if not offload:
        return params, opt, 0
    if zero_stage == 0:
        raise ValueError("offload needs ZeRO stage >= 1")
    if zero_stage == 3:
        return 0, 0, opt + params
    return params, 0, opt


def _checkpointing_flag(module) -> bool:
    """Whether the model (or a critic's / reward model's backbone) has gradient checkpointing on."""
    flag = bool(getattr(module, "is_gradient_checkpointing", False))
    backbone = getattr(module, "backbone", None)
    return flag | bool(getattr(backbone, "is_gradient_checkpointing", False))


def _activations(module, micro_batch_tokens: int, wbytes: int, n_train: int, gradient_checkpointing: bool) -> int:
    """The activation estimate of one micro-batch of ``micro_batch_tokens`` (0: none); a model without trainable
    parameters (inference) keeps only its logits."""
    config = _config_of(module)
    lm_head = getattr(module, "get_output_embeddings", lambda: None)() is not None
    if not (micro_batch_tokens and config is not None):
        return 0
    acts = activation_bytes(config, micro_batch_tokens, wbytes, gradient_checkpointing=gradient_checkpointing,
                            lm_head=lm_head)
    if n_train == 0:
        acts = micro_batch_tokens * config.vocab_size * wbytes if lm_head else 0  # inference: logits only
    return acts


def format_breakdown(b: dict) -> str:
    gib = 1024 ** 3
    keys = ("params", "grads", "optimizer_states", "activations", "device_total", "host_total")
    return ", ".join(f"{k}={b[k] / gib:.3f}GiB" for k in keys)
