"""Fused kernels for the model body (`model.kernels`): liger-kernel's RMSNorm, SwiGLU MLP and rotary embedding.

Hugging Face's eager RMSNorm, SiLU-gate-multiply and rotary embedding are several elementwise passes each, in forward
and backward; on a small-hidden model (the 0.5B shape: hidden 896) they are a large share of a training step.
liger-kernel (a maintained library of Triton kernels for exactly these layers) replaces each with one fused
kernel per direction, numerically equivalent; the parameters and their names stay the same, so DeepSpeed,
checkpoints, LoRA and the weight sync see no difference. The output head is not liger's: RL needs per-token
log-probs, which `algos/logprobs.py` computes chunked.

- ``none``: Hugging Face's own layers.
- ``liger``: liger's layers; an error naming the problem where they cannot run (no CUDA device, liger-kernel not
  installed, or a model type liger does not know).
- ``auto`` (default): ``liger`` on a CUDA device when liger-kernel is installed and knows the model type, else
  ``none`` (CPU runs, the CI, machines without it).

Figures: docs/PERFORMANCE.md, "Training phase".
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

CHOICES = ("auto", "liger", "none")
_LAYERS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
           "fused_linear_cross_entropy": False}


def _liger_fn(model_type: str):
    """liger's patch function for `model_type` (None if liger has none), or raise ImportError when not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError("liger-kernel is not installed (pip install liger-kernel)")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)


def resolve(mode: str, model_type: str | None, device_type: str) -> str:
    """`model.kernels` for this model and device: "liger" or "none" (raises ValueError for an impossible "liger").
    `model_type` None: not known yet (preflight before the model exists), so only the device and the install."""
    if mode not in CHOICES:
        raise ValueError(f"model.kernels must be one of {CHOICES}, got {mode!r}")
    if mode == "none":
        return "none"
    problem = None
    if device_type != "cuda":
        problem = f"liger's Triton kernels need a CUDA device (this run is on {device_type})"
    else:
        try:
            fn = _liger_fn(model_type or "")
            if model_type is not None and fn is None:
                problem = f"liger-kernel has no kernels for model type {model_type!r}"
        except ImportError as exc:
            problem = str(exc)
    if problem is None:
        return "liger"
    if mode == "liger":
        raise ValueError(f"model.kernels=liger: {problem}; use --model.kernels auto or none")
    return "none"


def run_device_type() -> str:
    """The device type runs train on: DeepSpeed's accelerator (DS_ACCELERATOR=cpu on a GPU host is "cpu")."""
    try:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().device_name()
    except ImportError:
        return "cuda" if torch.cuda.is_available() else "cpu"


def apply_kernels(model: torch.nn.Module, mode: str) -> str:
    """Swap `model`'s (a transformers model, before LoRA wrapping) RMSNorm / MLP / rotary forwards for liger's
    when `mode` resolves to "liger" on the run's device type; returns what was applied.

    liger patches the transformers module as well as the instance: its rotary kernel replaces the module-level
    function every model of that type calls, and its layer classes replace the module's, so models of that type
    built later in the same process get liger's layers whatever their own `kernels` (numerically the same)."""
    if mode == "none":
        return "none"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    chosen = resolve(mode, model_type, run_device_type())
    if chosen == "liger":
        # liger warns once per op for each optional backend it cannot import (CuTe-DSL, Ascend) although the Triton
        # kernels we use load fine; a failure of those raises on its own.
        logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
        fn = _liger_fn(model_type)
        params = inspect.signature(fn).parameters
        fn(model=model, **{k: v for k, v in _LAYERS.items() if k in params})
        logger.info("model.kernels: liger RMSNorm / SwiGLU / rotary kernels on the %s model", model_type)
    return chosen
