"""Attention back-end selection: flash-attention 2, PyTorch's varlen attention, or SDPA — chosen by measurement.

Packed, padding-free batches (one row, ``position_ids`` restarting at 0 for each sequence, no attention mask) are
already understood by transformers 5: ``masking_utils.find_packed_sequence_indices`` turns the restarts into a
block-diagonal mask for SDPA/eager, and its flash-attention path derives ``cu_seqlens`` from them. SDPA with that
mask is correct but still computes (and masks) the full ``T x T`` score matrix. A varlen kernel skips the
off-diagonal blocks, so we register ``torch.nn.attention.varlen.varlen_attn`` (CUDA-only, fp16/bf16; it raises
``NotImplementedError`` on CPU) under the name ``"torch_varlen"`` through transformers' ``AttentionInterface``.

Selection (``select_attn_impl("auto")``): if ``bench/attention.py --save-choice`` has recorded the fastest working
option for this device, use it; otherwise the first available of flash_attention_2 > torch_varlen > sdpa (padded
rows skip torch_varlen, below). Measurements are in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

VARLEN_NAME = "torch_varlen"
IMPLS = ("flash_attention_2", VARLEN_NAME, "sdpa", "eager")


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel(q, k, v, cu_seqlens: torch.Tensor, max_len: int, scale: float | None,
                  window: int | None = None) -> torch.Tensor:
    """Causal varlen attention on ``[total, heads, dim]`` tensors; adapts to the signature of the installed torch.

    torch 2.10 takes ``is_causal``; later versions take ``window_size`` (``(-1, 0)`` = causal) and ``enable_gqa``.
    """
    fn = _varlen_fn()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen is not available in this torch build")
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise ValueError("this torch's varlen_attn has no window_size; sliding-window attention is unsupported")
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, int]:
    """Sequence boundaries of a (possibly packed) ``[B, T]`` batch: a new sequence starts at every row start and
    wherever the position does not continue by +1. Returns int32 ``cu_seqlens`` and the longest sequence."""
    pos = position_ids.expand(batch, length).reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    start[::length] = True
    idx = start.nonzero().squeeze(-1)
    cu = torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def torch_varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                   sliding_window=None, **kwargs):
    """transformers attention function (``[B, H, T, D]`` in, ``[B, T, H, D]`` out) backed by varlen_attn.

    Handles packed rows (boundaries from ``position_ids``) and left/right padding (the 2D mask from
    ``flash_attention_mask``: valid tokens are gathered, attended, and scattered back; padded outputs are 0).
    """
    if dropout:
        raise ValueError("torch_varlen attention has no dropout; set attention_dropout=0")
    bsz, _, q_len, _ = query.shape
    if key.shape[2] != q_len:
        raise ValueError("torch_varlen attention is for full forward passes (training/scoring), not KV-cached "
                         "generation; use sdpa for generation")
    q, k, v = (t.transpose(1, 2).reshape(bsz * q_len, t.shape[1], t.shape[3]) for t in (query, key, value))
    keep = None
    if attention_mask is not None:
        mask = attention_mask.bool()
        keep = mask.reshape(-1).nonzero().squeeze(-1)
        lens = mask.sum(-1).to(torch.int32)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)])
        max_len = int(lens.max())
        q, k, v = q[keep], k[keep], v[keep]
    elif kwargs.get("cu_seq_lens_q") is not None:
        cu, max_len = kwargs["cu_seq_lens_q"].to(torch.int32), int(kwargs["max_length_q"])
    elif kwargs.get("position_ids") is not None:
        cu, max_len = cu_seqlens_from_position_ids(kwargs["position_ids"], bsz, q_len)
    else:
        cu = torch.arange(0, (bsz + 1) * q_len, q_len, dtype=torch.int32, device=query.device)
        max_len = q_len
    out = varlen_kernel(q, k, v, cu.to(query.device), max_len, scaling, sliding_window)
    if keep is not None:
        full = out.new_zeros(bsz * q_len, *out.shape[1:])
        full[keep] = out
        out = full
    return out.reshape(bsz, q_len, *out.shape[1:]), None


def register_torch_varlen() -> str:
    """Make ``attn_implementation="torch_varlen"`` loadable; its mask function is flash-attention's (2D or None)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN_NAME, torch_varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_NAME, flash_attention_mask)
    return VARLEN_NAME


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=16)
def varlen_works(device: str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Run varlen_attn once on ``device``; False when this build/device cannot (e.g. CPU: NotImplementedError)."""
    try:
        q = torch.randn(6, 2, 64, device=device, dtype=dtype)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
        varlen_kernel(q, q[:, :1], q[:, :1], cu, 4, None)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        logger.info("torch varlen_attn unavailable on %s/%s: %s", device, dtype, str(exc).splitlines()[0][:200])
        return False


def available_impls(device: str, dtype: torch.dtype) -> list[str]:
    """Implementations that can run on ``device`` with ``dtype``, in the provisional preference order."""
    out = []
    half = dtype in (torch.float16, torch.bfloat16)
    if str(device).startswith("cuda") and half and flash_attn_installed():
        out.append("flash_attention_2")
    if half and varlen_works(str(device), dtype):
        out.append(VARLEN_NAME)
    return out + ["sdpa", "eager"]


def device_key(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return "cpu"


def choice_path() -> Path:
    cache = Path(os.environ.get("DS_RLHF_CACHE", Path.home() / ".cache" / "ds_rlhf"))
    return Path(os.environ.get("DS_RLHF_ATTN_CHOICE", cache / "attention_choice.json"))


def measured_choice(device: str, dtype: torch.dtype) -> str | None:
    """The fastest implementation recorded by ``bench/attention.py --save-choice`` for this device and dtype."""
    path = choice_path()
    if not path.exists():
        return None
    entry = json.loads(path.read_text()).get(f"{device_key(device)}|{str(dtype).removeprefix('torch.')}")
    return entry["impl"] if entry else None


def select_attn_impl(requested: str = "auto", device: str | None = None,
                     dtype: torch.dtype = torch.bfloat16, *, padded: bool = False) -> str:
    """Resolve ``requested`` ("auto" or a name in IMPLS) to an ``attn_implementation`` string for transformers.

    ``padded``: the model will see right-padded rows with an attention mask (RL micro-batches without
    ``data.rl_packing``), not packed rows. ``torch_varlen`` then only gathers and scatters the valid tokens around
    the kernel SDPA runs directly, and measured slower: H200, Qwen2-0.5B shape, 98k tokens of 384-token rows, the RL
    update ran 71.9k tokens/s with torch_varlen and 82.4k with sdpa (docs/PERFORMANCE.md, 2026-12-01). So "auto"
    skips torch_varlen for padded rows (a recorded ``--save-choice`` still wins)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "cpu"
    if requested not in ("auto", *IMPLS):
        raise ValueError(f"attn_impl must be 'auto' or one of {IMPLS}, got {requested!r}")
    if requested in ("sdpa", "eager"):  # always available; no need to probe the other kernels
        return requested
    usable = available_impls(device, dtype)
    if requested != "auto":
        if requested not in usable:
            raise ValueError(f"attn_impl {requested!r} is not usable on {device} with {dtype}; usable: {usable}")
        choice = requested
    else:
        measured = measured_choice(device, dtype)
        if measured in usable:
            choice = measured
        else:
            choice = next(i for i in usable if not (padded and i == VARLEN_NAME))
    if choice == VARLEN_NAME:
        register_torch_varlen()
    logger.info("attention implementation: %s (device %s, %s)", choice, device, dtype)
    return choice
