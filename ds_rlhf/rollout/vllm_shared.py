"""`rollout.weight_transport shared` inside vLLM: the model loader that makes every parameter of a server's vLLM model
a view of one buffer the trainer owns (CUDA IPC on a GPU, a file in /dev/shm on CPU), so the weights exist once for
the trainer's side and every sidecar engine, and a sync is the trainer writing into that buffer.

`register_shared_loader()` registers `LOAD_FORMAT` with vLLM's public `register_model_loader`; the server puts the
mapped buffer in this module's slot (`set_shared_buffer`) and builds its engine in-process ("uni" executor,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with `load_format=LOAD_FORMAT`. vLLM's `BaseModelLoader.load_model` builds the
model (`initialize_model`), then calls the loader's `load_weights(model, model_config)`: ours first rebinds every
parameter (tied ones once) to its view of the buffer (`param.data = view`, the initial values copied in, the old
storage freed), at the offsets `shared_layout.plan_layout` gives, then runs the default `load_weights`, so the
checkpoint's weights land in the buffer. This happens while the model loads, before vLLM's profiling run,
torch.compile and CUDA-graph capture, so the captured graphs read the buffer itself. A rebinding after the engine
started would leave those graphs reading the freed storage: the parameters must never be rebound later, and a sync
only writes into the views. The layout (HF name, element offset, shape per component) is kept on the model
(`ds_rlhf_shared`) and read back through the worker extension (`shared_report`), with the bytes of parameters
outside the buffer (0 unless vLLM replaced a parameter after loading; the server refuses to serve then).

vLLM read for this (0.32 here; 0.26 on the GPU machine has the same loader API): `register_model_loader`,
`DefaultModelLoader.load_weights(model, model_config)` called by `BaseModelLoader.load_model` after
`initialize_model`, `DefaultModelLoader` picking checkpoint files by `load_config.load_format` (our copy of the
config says "auto"), the model class's `packed_modules_mapping`, `output_sizes` of packed linear layers and the
vocabulary embeddings' `org_vocab_size` / `num_embeddings_padded`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.shared_layout import ParamSpec, packed_spec, plain_spec, plan_layout, slots_to_wire

LOAD_FORMAT = "ds_rlhf_shared"
_SLOT: dict = {"buffer": None}  # the mapped shared buffer, set by the server before it builds its engine
_REGISTERED: list = []


def set_shared_buffer(buffer: torch.Tensor | None) -> None:
    """The buffer the next model load places its parameters in (None: none; a load then fails)."""
    _SLOT["buffer"] = buffer


def describe(model: nn.Module) -> tuple[list[ParamSpec], list[nn.Parameter]]:
    """Every parameter of the vLLM model once (tied ones by identity), as a `ParamSpec`, with the parameter."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), module)
    specs, params = [], []
    for name, p in model.named_parameters():
        module = owners[id(p)]
        sizes = getattr(module, "output_sizes", None)
        if sizes is not None and len(sizes) > 1 and any(part in mapping for part in name.split(".")):
            specs.append(packed_spec(name, p.shape, mapping, sizes))
        elif hasattr(module, "num_embeddings_padded") and p.dim() == 2:
            specs.append(plain_spec(name, p.shape, rows=module.org_vocab_size))
        else:
            specs.append(plain_spec(name, p.shape))
        params.append(p)
    return specs, params


def rebind_into_buffer(model: nn.Module, buffer: torch.Tensor) -> None:
    """Every parameter of `model` becomes a view of `buffer` (values kept); the layout is kept on the model."""
    specs, params = describe(model)
    odd = [(s.name, p.dtype, p.device) for s, p in zip(specs, params)
           if p.dtype != buffer.dtype or p.device != buffer.device]
    if odd:
        raise RolloutError(f"shared weights: the vLLM parameter {odd[0][0]} is {odd[0][1]} on {odd[0][2]}, the "
                           f"shared buffer {buffer.dtype} on {buffer.device}; every parameter must be in the buffer's "
                           "dtype on its device (no quantization)")
    offsets, slots, end = plan_layout(specs, buffer.element_size())
    if end > buffer.numel():
        raise RolloutError(f"shared weights: the vLLM model needs {end} elements of the shared buffer, which holds "
                           f"{buffer.numel()} (sized from the trainer's parameters)")
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = buffer[offset: offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
    model.ds_rlhf_shared = {"layout": slots_to_wire(slots),
                            "span": (buffer.data_ptr(), buffer.numel() * buffer.element_size())}


def shared_report(model: nn.Module) -> dict:
    """The layout the loader placed `model` in and the bytes of its parameters lying outside the shared buffer."""
    info = getattr(model, "ds_rlhf_shared", None)
    if info is None:
        raise RolloutError("this vLLM model was not loaded by the shared-weights loader (load_format "
                           f"{LOAD_FORMAT!r})")
    start, nbytes = info["span"]
    seen, outside = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        if not (start <= p.data_ptr() and p.data_ptr() + size <= start + nbytes):
            outside += size
    return {"layout": info["layout"], "outside_bytes": outside}


def _loader_class():
    """Our subclass of vLLM's `DefaultModelLoader` (defined here: vLLM is imported inside functions only)."""
    from vllm.model_executor.model_loader import DefaultModelLoader

    class SharedWeightsLoader(DefaultModelLoader):
        """The default loader, after rebinding the model's parameters into the shared buffer."""

        def __init__(self, load_config) -> None:
            config = copy.copy(load_config)
            config.load_format = "auto"  # the default loader picks checkpoint files by this name
            super().__init__(config)

        def load_weights(self, model: nn.Module, model_config) -> None:
            buffer = _SLOT["buffer"]
            if buffer is None:
                raise RolloutError("shared weights: no shared buffer in this process; the shared-weights loader "
                                   "runs in the server's own process only (executor 'uni', tensor parallel 1)")
            rebind_into_buffer(model, buffer)
            super().load_weights(model, model_config)

    return SharedWeightsLoader


def register_shared_loader() -> str:
    """Register our loader with vLLM under `LOAD_FORMAT` (once per process); returns the format name."""
    if not _REGISTERED:
        from vllm.model_executor.model_loader import register_model_loader

        _REGISTERED.append(register_model_loader(LOAD_FORMAT)(_loader_class()))
    return LOAD_FORMAT
