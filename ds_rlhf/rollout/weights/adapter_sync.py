"""Adapter-only weight sync: the rollout engine serves the frozen base once and takes only the LoRA adapters per step.

Why: with a LoRA actor on a frozen base (`model.lora_rank > 0`) every step changes the adapters alone, a few MB where
the merged model is GBs. The merged sync (`weight_gather.py`) still gathers and ships the whole base each step;
here the engine (vLLM started with LoRA enabled, `vllm_handle.VLLMHandle(lora_rank=...)`) loads the base from the
model path at start, and each sync gathers the adapters' A/B tensors, writes them as a peft adapter directory
(`adapter_model.safetensors` + `adapter_config.json`, the format vLLM's LoRA loader reads in 0.26 and 0.32) and
tells the engine to serve that directory as a new adapter version. A new version id per sync is what makes vLLM
read the new tensors: it caches adapters by id, so the same id again would serve the old ones.

What goes out: every active peft LoRA layer's `lora_A` / `lora_B` weights, named as peft saves them
(`base_model.model.<HF module>.lora_A.weight`), cast to the engine's dtype; the config is the actor's own
`LoraConfig` (rank, alpha, targets, rslora), so vLLM scales B @ A exactly as peft does. A quantized base
(`model.quantize_base`) differs from the checkpoint vLLM loaded, so the first sync also sends the base once,
dequantized and unmerged (`iter_weight_buckets(merge_lora=False)`).

Refused (RolloutError): trainable weights outside the adapters (their updates would never reach the engine), DoRA,
LoRA on embeddings, several active adapters. The directory is written under a temporary name and renamed into
place, so the engine never reads a half-written adapter; older versions are removed once the new one is loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ds_rlhf.distributed import world
from ds_rlhf.engines import quantized
from ds_rlhf.engines.models import unwrap
from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.weights.gather import Entry, full_shape, hf_name

ADAPTER_FILE = "adapter_model.safetensors"


def _lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in module.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def active_adapter(module: nn.Module) -> str:
    """The name of the peft model's one active adapter (RolloutError for none or several)."""
    active = getattr(module, "active_adapters", None) or [getattr(module, "active_adapter", None)]
    if isinstance(active, str):
        active = [active]
    if len(active) != 1 or active[0] is None or not _lora_layers(module):
        raise RolloutError(f"adapter sync needs a peft model with exactly one active LoRA adapter, got {active} on "
                           f"{type(module).__name__}; use rollout.lora_sync=merged")
    return active[0]


def adapter_entries(module: nn.Module) -> list[Entry]:
    """One entry per LoRA A / B weight of the active adapter, named as in peft's `adapter_model.safetensors`."""
    name = active_adapter(module)
    entries = []
    for layer_name, layer in _lora_layers(module).items():
        if getattr(layer, "lora_embedding_A", None):
            raise RolloutError(f"LoRA on the embedding {layer_name}: adapter sync sends Linear LoRA only")
        if name not in layer.lora_A:
            continue
        if getattr(layer, "lora_magnitude_vector", None) and name in layer.lora_magnitude_vector:
            raise RolloutError(f"DoRA adapter on {layer_name}: adapter sync does not send DoRA; use lora_sync=merged")
        prefix = f"base_model.model.{hf_name(layer_name)}"
        for part in ("lora_A", "lora_B"):
            w = getattr(layer, part)[name].weight
            entries.append(Entry(f"{prefix}.{part}.weight", full_shape(w), [w]))
    return entries


def check_frozen_base(module: nn.Module) -> None:
    """RolloutError when a weight outside the LoRA adapters trains: adapter sync would never send its updates."""
    trained = [n for n, p in module.named_parameters() if p.requires_grad and ".lora_" not in n]
    if trained:
        raise RolloutError(f"rollout.lora_sync=adapter sends only the LoRA adapters, but {len(trained)} other "
                           f"weights train ({', '.join(trained[:3])}...); their updates would never reach the rollout "
                           "engine: use rollout.lora_sync=merged")


def base_is_quantized(module: nn.Module) -> bool:
    """True when the frozen base is stored quantized (then it differs from the checkpoint the engine loaded)."""
    return any(quantized.is_quantized(p) for p in module.parameters())


def lora_config(module: nn.Module):
    """The active adapter's peft `LoraConfig` (what vLLM reads from `adapter_config.json`)."""
    return unwrap(module).peft_config[active_adapter(unwrap(module))]


class AdapterDir:
    """Numbered peft adapter directories under `root` (a private temporary directory when None; `per_rank`: a
    given root gets a `rank<r>` subdirectory, so the ranks of one run never write over each other's versions),
    written atomically: tensors and config go to a hidden temporary directory that is then renamed to `v<version>`."""

    def __init__(self, root: str | os.PathLike | None = None, *, per_rank: bool = False) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ds_rlhf_lora_") if root is None else None
        self.root = Path(self._tmp.name if self._tmp is not None else root)
        if root is not None and per_rank:
            self.root = self.root / f"rank{world()[0]}"
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, version: int, tensors: dict[str, torch.Tensor], config) -> Path:
        from safetensors.torch import save_file

        final = self.root / f"v{version:06d}"
        tmp = self.root / f".v{version:06d}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a leftover of an earlier run with the same root
        tmp.mkdir()
        save_file(tensors, str(tmp / ADAPTER_FILE))
        config.save_pretrained(str(tmp))
        os.replace(tmp, final)
        return final

    def prune(self, keep: Path) -> None:
        """Remove every version but `keep` (the engine has read it; older ones are not served)."""
        for path in self.root.glob("v*"):
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
