"""A quantized frozen base (`model.quantize_base`: nf4 | int8) under LoRA, through bitsandbytes.

Why: with LoRA only the adapters train, so the base weights are read-only and may be stored at 4 or 8 bits (QLoRA).
An 8B model's base then takes ~4.5 GiB (nf4) or ~8 GiB (int8) instead of 16 GiB in bf16, which is what lets the
actor, vLLM and the activations share one 24 GiB GPU without streaming the base from host memory (ZeRO-3 offload).

How: transformers loads the model with a `BitsAndBytesConfig` (`load_kwargs`): every `nn.Linear` of the decoder
becomes a bitsandbytes `Linear4bit` (NF4, double-quantized absmax, blocks of 64) or `Linear8bitLt` (row-wise absmax
int8) whose weight is a `Params4bit` / `Int8Params` (packed uint8 / int8 storage, scales beside it). The output head
(`lm_head`), a reward model's `score` head and the embeddings stay in the compute dtype, as do the norms and biases.
peft's `prepare_model_for_kbit_training` (`prepare_for_lora`) freezes the base and sets up gradient checkpointing
the way peft's k-bit LoRA layers expect; `apply_lora` then wraps the bitsandbytes layers with peft's `lora.bnb`
layers, so the adapters (and only they) train in the compute dtype on top of the quantized matmul.

bitsandbytes (>= 0.45) has a CPU backend, so the CPU tests exercise the same code as a GPU run. What leaves the
trainer is always dequantized: the weight sync to vLLM (`rollout/weights/gather.py`) and the export
(`models.merge_lora_state_dict`) send `dequantize(base) + scaling * B @ A` in the rollout / export dtype.

ZeRO-3 is refused (`config_rules` at parse time, `check_ds_config` on the resolved ds_config): it would
partition the packed uint8 / int8 storage into flat shards while the `quant_state` / `SCB` that bitsandbytes keeps
on the parameter object stays whole, a combination neither DeepSpeed nor bitsandbytes supports (a probe trained at
world size 1, which proves nothing about the gathers across ranks, the offload or the weight sync); a 4-bit 8B
base needs no partitioning on a 24 GiB GPU. ZeRO-0/1/2 leave frozen weights whole and untouched.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ds_rlhf.errors import ConfigError

QUANT_MODES = ("none", "nf4", "int8")
KEEP_FULL = ["lm_head", "score"]  # heads stay in the compute dtype (transformers skips the tied/output embedding)
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block size
NESTED_BLOCK = 256  # double quantization: one fp32 scale per 256 blocks' 8-bit absmax
INT8_STATE = "ds_rlhf_int8_state"  # attribute on an Int8Params: its layer's MatmulLtState (holds SCB after a forward)


def enabled(mode: str | None) -> bool:
    return bool(mode) and mode != "none"


def check_mode(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise ValueError(f"model.quantize_base={mode!r}: use one of {', '.join(QUANT_MODES)}")


def check_ds_config(mode: str | None, ds_config: dict) -> None:
    """Refuse ZeRO-3 with a quantized base, on the resolved ds_config (the schema's rule in `config_rules`,
    sees only --zero_stage and a readable ds_config file); one line naming the keys."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if enabled(mode) and stage == 3:
        raise ConfigError(f"model.quantize_base={mode} needs ZeRO stage 0, 1 or 2, got zero_optimization.stage 3: "
                          "ZeRO-3 would partition bitsandbytes' packed weights apart from their quantization state; "
                          "set --zero_stage 2 or --model.quantize_base none")


def _device_map() -> dict:
    """bitsandbytes quantizes when the weights reach their device: this rank's GPU, else the CPU."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))}
    return {"": "cpu"}


def bnb_config(mode: str, compute_dtype: torch.dtype):
    """transformers' `BitsAndBytesConfig` for `mode` (QLoRA's defaults for nf4: double quantization)."""
    from transformers import BitsAndBytesConfig

    check_mode(mode)
    if mode == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=list(KEEP_FULL))
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(KEEP_FULL))


def load_kwargs(mode: str | None, compute_dtype: torch.dtype) -> dict:
    """Extra `from_pretrained` keywords that load the base quantized (empty for "none")."""
    if not enabled(mode):
        return {}
    return {"quantization_config": bnb_config(mode, compute_dtype), "device_map": _device_map()}


def keep_standard_layout(model: nn.Module) -> nn.Module:
    """Turn off bitsandbytes' CPU repacking of 4-bit layers. On a CPU with AVX512-BF16 a `Linear4bit` would, at its
    first no-grad forward in eval mode, repack its weight in place into bitsandbytes' CPU inference layout (bf16
    block scales, a fused bf16 kernel from then on, in training too): the trainer would compute in bf16 instead of
    the compute dtype, and the weight sync would read a layout `dequantize` does not know (the canary caught it:
    log-prob differences of 0.003-0.8 on an AMD EPYC with AVX512-BF16)."""
    for sub in model.modules():
        if hasattr(sub, "support_avx512bf16_for_cpu"):
            sub.support_avx512bf16_for_cpu = False
    return model


def prepare_for_lora(model: nn.Module) -> nn.Module:
    """peft's k-bit preparation: the base frozen, half-precision float weights (norms, embeddings) up-cast to fp32.
    Gradient checkpointing is left to the caller (`models._enable_gc`, non-reentrant: no input-grad hook needed),
    since peft only enables it on a top-level model flagged `is_loaded_in_4bit`, not on a critic's backbone.

    An 8-bit layer moves its row scales from the weight (`Int8Params.SCB`) to the layer's `state` on its first
    forward; the weight keeps a reference to that state (`INT8_STATE`) so it can be dequantized from the parameter
    alone (the weight sync walks parameters, not layers). 4-bit layers keep the standard layout on every CPU
    (`keep_standard_layout`)."""
    from peft import prepare_model_for_kbit_training

    keep_standard_layout(model)
    for sub in model.modules():
        if type(getattr(sub, "weight", None)).__name__ == "Int8Params" and hasattr(sub, "state"):
            setattr(sub.weight, INT8_STATE, sub.state)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False, auto_clear_cache=False)


# ---- quantized parameters --------------------------------------------------------------------------------------
def _int8_scales(p: torch.Tensor) -> torch.Tensor | None:
    """An 8-bit weight's fp32 row scales: on the weight until the first forward, then on its layer's state."""
    scb = getattr(p, "SCB", None)
    if scb is None and getattr(p, INT8_STATE, None) is not None:
        scb = getattr(p, INT8_STATE).SCB
    return scb


def is_quantized(p: torch.Tensor) -> bool:
    """A bitsandbytes weight (4-bit `Params4bit` with its quant_state, or 8-bit `Int8Params` with its scales)."""
    return (type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is not None) or (
        type(p).__name__ == "Int8Params" and _int8_scales(p) is not None)


def logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The weight's [out, in] shape (a 4-bit weight is stored packed as [numel / 2, 1] uint8)."""
    if type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is not None:
        return tuple(p.quant_state.shape)
    return tuple(p.shape)


def logical_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a quantized weight dequantizes to: a 4-bit weight's load dtype (its quant_state's), fp32 for int8."""
    if type(p).__name__ == "Params4bit":
        return p.quant_state.dtype
    return torch.float32 if type(p).__name__ == "Int8Params" else p.dtype


def dequantize(p: torch.Tensor) -> torch.Tensor:
    """The full-precision [out, in] weight of a quantized parameter, through bitsandbytes' own kernels."""
    import bitsandbytes.functional as F

    if type(p).__name__ == "Params4bit":
        return F.dequantize_4bit(p.data, p.quant_state)
    if type(p).__name__ == "Int8Params" and (scales := _int8_scales(p)) is not None:
        return F.int8_vectorwise_dequant(p.data, scales.to(p.data.device))
    raise TypeError(f"{type(p).__name__} is not a bitsandbytes quantized weight (or has lost its scales)")


def quantized_names(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict name -> parameter of every quantized weight in `module`."""
    return {n: p for n, p in module.named_parameters() if is_quantized(p)}


def dequantize_state_dict(state: dict, module: nn.Module) -> dict:
    """`state` (a `module.state_dict()`) with each quantized weight replaced by its dequantized value, in the dtype
    of the state's other floating-point weights, and bitsandbytes' side entries (`.absmax`, `.quant_map`,
    `.quant_state.*`, `.SCB`, `.weight_format`) dropped. `state` itself is returned when nothing is quantized."""
    weights = {n: p for n, p in quantized_names(module).items() if n in state}
    if not weights:
        return state
    out = dict(state)
    for name in weights:
        for key in [k for k in out if k.startswith(name + ".")]:
            del out[key]
        out.pop(name.removesuffix("weight") + "SCB", None)
        out.pop(name.removesuffix("weight") + "weight_format", None)
    floats = [v.dtype for k, v in out.items() if k not in weights and torch.is_tensor(v) and v.is_floating_point()]
    for name, p in weights.items():
        value = dequantize(p)
        out[name] = value.to(floats[0]) if floats else value
    return out


# ---- the memory plan ---------------------------------------------------------------------------------------------
def quantized_weight_bytes(out_features: int, in_features: int, mode: str) -> int:
    """Bytes of one quantized [out, in] weight as bitsandbytes stores it. nf4: two values per byte, one 8-bit absmax
    per 64-value block, and for that absmax (double quantization) one fp32 per 256 blocks, a 256-entry fp32 code
    book and an fp32 offset, plus the 16-entry fp32 NF4 code book (~0.516 byte per value). int8: one byte per value
    and one fp32 scale per row. `stored_bytes` measures the same on a loaded weight."""
    numel = out_features * in_features
    if mode == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        return -(-numel // 2) + blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * (NESTED_BLOCK + 1) + 4 * 16
    if mode == "int8":
        return numel + 4 * out_features
    raise ValueError(f"no quantized size for mode {mode!r}")


def stored_bytes(p: torch.Tensor) -> int:
    """Bytes a loaded bitsandbytes weight really holds: its packed storage plus every tensor of its quantization
    state (absmax, code books, offset, the nested state) or its row scales."""
    def nbytes(t) -> int:
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    total = nbytes(p.data)
    if type(p).__name__ == "Params4bit":
        qs = p.quant_state
        total += nbytes(qs.absmax) + nbytes(qs.code) + nbytes(getattr(qs, "offset", None))
        if getattr(qs, "nested", False):
            total += nbytes(qs.state2.absmax) + nbytes(qs.state2.code)
    elif type(p).__name__ == "Int8Params":
        total += nbytes(_int8_scales(p))
    return total


def quantizable_linears(module: nn.Module) -> list[nn.Linear]:
    """The `nn.Linear` layers a quantized load would convert: every one except the heads and the LoRA adapters
    (works on `meta` models: only shapes are read). peft's LoRA layers count by their `base_layer`."""
    out = []
    for name, sub in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(sub, nn.Linear) or leaf in KEEP_FULL or leaf == "value_head":
            continue
        if ".lora_" in f".{name}" or any(part.startswith("lora_") for part in name.split(".")):
            continue
        out.append(sub)
    return out


def base_bytes_saved(module: nn.Module, mode: str, weight_bytes: int) -> tuple[int, int]:
    """(parameters quantized, bytes saved) when `module`'s linear weights, counted at `weight_bytes` each, are
    stored quantized instead."""
    if not enabled(mode):
        return 0, 0
    numel = saved = 0
    for lin in quantizable_linears(module):
        n = lin.out_features * lin.in_features
        numel += n
        saved += n * weight_bytes - quantized_weight_bytes(lin.out_features, lin.in_features, mode)
    return numel, saved
