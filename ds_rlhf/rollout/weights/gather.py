"""Stream a trainer's weights out as (Hugging Face name, full tensor) buckets, at any ZeRO stage.

Why buckets: under ZeRO-3 every rank holds a 1/N slice of each parameter. Gathering one parameter at a time costs a
collective per tensor (hundreds per model: slow), gathering everything at once costs a full model copy per rank
(OOM at scale). We gather groups of parameters whose gathered size stays under `bucket_bytes` (1 GiB default),
hand each bucket to the consumer, and release it before gathering the next. ZeRO-0/1/2 parameters are already
whole; they are bucketed the same way so consumers see one code path.

What comes out is what vLLM's `load_weights` expects: checkpoint (Hugging Face) names, wrappers stripped, tied
weights sent once (vLLM re-ties them), LoRA adapters merged into their base weights (vLLM then serves the merged
model; no LoRA support needed on its side; `adapter_sync.py` is the adapters-only alternative), tensor-parallel
slicing left to vLLM's loaders. A quantized base (`model.quantize_base`: bitsandbytes 4-/8-bit weights,
`engines/quantized.py`) goes out dequantized: each packed weight is expanded by bitsandbytes to its [out, in] value
(plus the LoRA delta) and cast to the output dtype, so vLLM receives the same full-precision checkpoint names and
shapes as without quantization, never the packed storage.

The iterator is collective under ZeRO-3: every trainer rank must drain it, even ranks that send nothing.
Tensors in a bucket are only valid until the next bucket is requested (the gathered storage is released).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ds_rlhf.engines import quantized
from ds_rlhf.engines.models import unwrap
from ds_rlhf.rollout.base import BucketPlan, TensorMeta

DEFAULT_BUCKET_BYTES = 1 << 30
_STRIP = [
    (re.compile(r"^(module\.)+"), ""),                 # DeepSpeed / DDP wrappers
    (re.compile(r"^base_model\.model\."), ""),          # PEFT PeftModel
    (re.compile(r"(^|\.)_orig_mod\."), r"\1"),           # torch.compile
    (re.compile(r"(^|\.)_fsdp_wrapped_module\."), r"\1"),
    (re.compile(r"(^|\.)_checkpoint_wrapped_module\."), r"\1"),
    (re.compile(r"\.base_layer(?=\.)"), ""),             # PEFT LoRA: base weight of a LoRA layer
    (re.compile(r"\.modules_to_save\.[^.]+(?=\.)"), ""),  # PEFT fully-trained copies (the active adapter's)
]


def hf_name(name: str) -> str:
    for pattern, repl in _STRIP:
        name = pattern.sub(repl, name)
    return name


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The tensor's full shape (a 4-bit weight's [out, in], not its packed storage's)."""
    if _is_partitioned(p):
        return tuple(p.ds_shape)
    return quantized.logical_shape(p) if quantized.is_quantized(p) else tuple(p.shape)


def _value_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a tensor goes out in when no output dtype is given (a quantized weight: its dequantized dtype)."""
    return quantized.logical_dtype(p) if quantized.is_quantized(p) else p.dtype


def _value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value: its data, or a quantized weight dequantized by bitsandbytes."""
    return quantized.dequantize(p) if quantized.is_quantized(p) else p.data


def _gathered_bytes(p: torch.Tensor) -> int:
    numel = p.ds_numel if _is_partitioned(p) else p.numel()
    return numel * p.element_size()


@dataclass
class Entry:
    """One output tensor: its name/shape, the parameters it is computed from, and how."""

    name: str
    shape: tuple[int, ...]
    params: list[torch.Tensor]
    lora: tuple[list[tuple[torch.Tensor, torch.Tensor, float]], bool] | None = None  # ([(A, B, scale)], fan_in_fan_out)


def _lora_parts(layer: nn.Module) -> tuple[list[tuple[torch.Tensor, torch.Tensor, float]], bool]:
    """Active, unmerged LoRA (A, B, scaling) triples of a PEFT LoRA layer; raises on variants we do not merge."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return [], False  # adapters off, or already merged into base_layer by the user
    active = layer.active_adapters if hasattr(layer, "active_adapters") else [layer.active_adapter]
    parts = []
    for name in active:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "lora_magnitude_vector", None) and name in layer.lora_magnitude_vector:
            raise NotImplementedError(f"DoRA adapter {name!r}: merging DoRA weights for sync is not supported")
        a, b = layer.lora_A[name], layer.lora_B[name]
        if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)):
            raise NotImplementedError(f"LoRA adapter {name!r} on {type(layer).__name__}: only Linear LoRA merges")
        parts.append((a.weight, b.weight, float(layer.scaling[name])))
    return parts, bool(getattr(layer, "fan_in_fan_out", False))


def collect_entries(module: nn.Module, name_map: Callable[[str], str | None] | None = None, *,
                    merge_lora: bool = True) -> list[Entry]:
    """Walk the module once: canonical names, tied weights once, LoRA layers as merged entries (`merge_lora=False`:
    their base weights alone, for an engine that applies the adapters itself)."""
    lora_layers = {n: m for n, m in module.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    if any(getattr(m, "lora_embedding_A", None) for m in lora_layers.values()):
        raise NotImplementedError("LoRA on embeddings: merging for sync is not supported; target Linear layers")
    skip_ids: set[int] = set()
    lora_of: dict[int, tuple[list, bool]] = {}
    for layer in lora_layers.values():
        parts, fan = _lora_parts(layer) if merge_lora else ([], False)
        for sub in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
            for p in getattr(layer, sub, nn.ModuleDict()).parameters():
                skip_ids.add(id(p))
        if parts:
            lora_of[id(layer.base_layer.weight)] = (parts, fan)
    # Tied weights: several names, one tensor. Prefer the non-head name (vLLM ties lm_head to embed_tokens).
    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if ".original_module." in name or id(p) in skip_ids:
            continue  # PEFT keeps the frozen original next to modules_to_save; the trained copy is what we send
        names_of.setdefault(id(p), []).append(name)
        params[id(p)] = p
    entries = []
    for pid, names in names_of.items():
        names = sorted(names, key=lambda n: (n.endswith("lm_head.weight"), names.index(n)))
        out = hf_name(names[0])
        if name_map is not None:
            out = name_map(out)
            if out is None:
                continue
        p = params[pid]
        lora = lora_of.get(pid)
        extra = [t for a, b, _ in lora[0] for t in (a, b)] if lora else []
        entries.append(Entry(out, full_shape(p), [p, *extra], lora))
    return entries


def plan_buckets(entries: list[Entry], bucket_bytes: int, dtype: torch.dtype | None) -> list[list[Entry]]:
    """Greedy in-order grouping: gathered bytes per bucket <= bucket_bytes (a larger single tensor goes alone);
    a bucket never mixes output dtypes, so it flattens into one buffer."""
    buckets: list[list[Entry]] = []
    size, cur_dtype = 0, None
    for e in entries:
        nbytes = sum(_gathered_bytes(p) for p in e.params)
        out_dtype = dtype or _value_dtype(e.params[0])
        if not buckets or size + nbytes > bucket_bytes or out_dtype != cur_dtype:
            buckets.append([])
            size, cur_dtype = 0, out_dtype
        buckets[-1].append(e)
        size += nbytes
    return buckets


class WeightBuckets:
    """Iterator over buckets of (name, tensor); `.plan` lists every bucket's metadata before any gather happens
    (a disaggregated engine sends it ahead as the sync's one control message)."""

    def __init__(self, engine_or_module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, dtype: torch.dtype | None = None,
                 name_map: Callable[[str], str | None] | None = None, merge_lora: bool = True,
                 entries: list[Entry] | None = None) -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        self.module = unwrap(engine_or_module)
        self.dtype = dtype
        if entries is None:
            entries = collect_entries(self.module, name_map, merge_lora=merge_lora)
        self._buckets = plan_buckets(entries, bucket_bytes, dtype)
        self.plan: BucketPlan = [[TensorMeta(e.name, e.shape, dtype or _value_dtype(e.params[0])) for e in b]
                                 for b in self._buckets]
        self.zero3 = any(_is_partitioned(p) for b in self._buckets for e in b for p in e.params)
        self.bytes = 0  # bytes yielded so far (output dtype)
        self.max_gathered_bytes = 0
        self._it = self._generate()

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self

    def __next__(self) -> list[tuple[str, torch.Tensor]]:
        return next(self._it)

    def __len__(self) -> int:
        return len(self._buckets)

    def drain(self) -> None:
        """Run the remaining gathers without using the tensors (ranks that send nothing, under ZeRO-3)."""
        for _ in self:
            pass

    def _generate(self):
        for bucket in self._buckets:
            params = [p for e in bucket for p in e.params]
            gathered = sum(_gathered_bytes(p) for p in params)
            self.max_gathered_bytes = max(self.max_gathered_bytes, gathered)
            ctx = _gather(params) if self.zero3 else contextlib.nullcontext()
            with ctx, torch.no_grad():
                out = [(e.name, self._materialize(e)) for e in bucket]
                self.bytes += sum(t.numel() * t.element_size() for _, t in out)
                yield out
                del out

    def _materialize(self, e: Entry) -> torch.Tensor:
        w = _value(e.params[0])
        out_dtype = self.dtype or _value_dtype(e.params[0])
        if e.lora:
            parts, fan_in_fan_out = e.lora
            delta = sum(b.data.float() @ a.data.float() * scale for a, b, scale in parts)
            w = w.float() + (delta.T if fan_in_fan_out else delta)
        return w if w.dtype == out_dtype else w.to(out_dtype)


def _gather(params: list[torch.Tensor]):
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def iter_weight_buckets(engine_or_module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                        dtype: torch.dtype | None = None, name_map: Callable[[str], str | None] | None = None,
                        merge_lora: bool = True) -> WeightBuckets:
    """Buckets of (HF name, full tensor) from a DeepSpeed engine (any ZeRO stage) or plain nn.Module.

    `dtype` casts on the way out (e.g. to the rollout engine's dtype, halving bytes for fp32 masters -> bf16).
    `name_map` renames (or drops, by returning None) a tensor after the standard wrapper stripping.
    `merge_lora=False` sends LoRA layers' base weights without their adapters (adapter sync's base, sent once).
    """
    return WeightBuckets(engine_or_module, bucket_bytes, dtype=dtype, name_map=name_map, merge_lora=merge_lora)
