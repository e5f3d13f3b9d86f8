"""The trainer's weight buffer of `rollout.weight_transport shared` (`transports.SharedWeights`): one flat tensor in
the rollout dtype, allocated before any server builds its engine and sized from the trainer's parameters
(`shared_layout.buffer_numel` over the checkpoint's model, built on the meta device: the names and shapes the
trainer syncs, tied weights once). Every server maps it ('start' carries `rebuild`) and its vLLM parameters become
views of it (`vllm_shared.py`):

- GPU (a sidecar on the trainer's device): a CUDA tensor shared with `reduce_tensor`, as `OwnIPC`'s buffer; a
  server rebuilds it with `rebuild_fn(*args)`.
- CPU (the CPU tests; vLLM on CPU runs float32): a file in /dev/shm both processes map with
  `torch.from_file(path, shared=True, ...)`, removed by `close`; the next buffer's start removes the files of
  killed runs that no process maps any more (`cpu_shm.remove_unmapped`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ds_rlhf.rollout.base import BucketPlan, RolloutError
from ds_rlhf.rollout.shared_layout import Slot, buffer_numel, model_parameter_shapes
from ds_rlhf.rollout.vllm_mapping import DTYPE_NAMES
from ds_rlhf.rollout.weights.cpu_shm import remove_unmapped

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ds_rlhf_shared_"
_HALF = (torch.bfloat16, torch.float16)


def hf_parameter_shapes(model_path: str) -> tuple[list[tuple[str, tuple[int, ...]]], set[str], torch.dtype | None]:
    """The checkpoint's model as the trainer holds it, built on the meta device: its parameters' (name, shape),
    tied ones once; the names of its vocabulary embeddings; the checkpoint's dtype (None where it names none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = vars(config).get("dtype") or vars(config).get("torch_dtype")  # the spelling of the installed transformers
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return (*model_parameter_shapes(model), dtype if isinstance(dtype, torch.dtype) else None)


def buffer_dtype(dtype: str, *, cpu: bool, checkpoint: torch.dtype | None) -> torch.dtype:
    """The dtype of the buffer and of the engines' weights: the rollout dtype; "auto" is float32 on CPU, else the
    checkpoint's half dtype, else bfloat16."""
    name = DTYPE_NAMES.get(dtype, dtype)
    if name == "auto":
        if cpu:
            return torch.float32
        return checkpoint if checkpoint in _HALF else torch.bfloat16
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        raise RolloutError(f"shared weights: unknown rollout dtype {dtype!r}")
    return resolved


def check_plan(slots: dict[str, Slot], plan: BucketPlan) -> None:
    """A sync's plan against the engines' layout: RolloutError (one line, the first offending tensor) for a name
    with no slot, a shape unlike its slot's, or a slot the sync leaves out."""
    names = set()
    for meta in (m for metas in plan for m in metas):
        slot = slots.get(meta.name)
        if slot is None or tuple(meta.shape) != slot.shape:
            where = "has no slot" if slot is None else f"is {list(meta.shape)}, its slot {list(slot.shape)}"
            raise RolloutError(f"rollout.weight_transport=shared: {meta.name} {where} in the engines' buffer")
        names.add(meta.name)
    missing = [n for n in slots if n not in names]
    if missing:
        raise RolloutError(f"rollout.weight_transport=shared: the sync leaves out {missing[0]} (and "
                           f"{len(missing) - 1} more): every weight the engines hold comes in each sync")


class SharedBuffer:
    """`numel` elements of `dtype`, on the current CUDA device (`cuda`) or in a /dev/shm file; `rebuild` is the
    (function, arguments) a server maps it with; `layout` the places the engines' parameters hold (set once the
    first server started)."""

    def __init__(self, numel: int, dtype: torch.dtype, *, cuda: bool) -> None:
        self.numel, self.dtype, self.path = int(numel), dtype, None
        self.layout: list[Slot] | None = None
        if cuda:
            self.tensor = torch.empty(self.numel, dtype=dtype, device=torch.cuda.current_device())
            self.rebuild = reduce_tensor(self.tensor)
        else:
            directory = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
            remove_unmapped(os.path.join(directory, f"{SHM_PREFIX}*.bin"))  # what killed runs left behind
            fd, self.path = tempfile.mkstemp(prefix=SHM_PREFIX, suffix=".bin", dir=directory)
            os.close(fd)
            self.tensor = torch.from_file(self.path, shared=True, size=self.numel, dtype=dtype)
            self.rebuild = (functools.partial(torch.from_file, shared=True, size=self.numel, dtype=dtype),
                            (self.path,))

    @classmethod
    def for_model(cls, model_path: str, dtype: str, *, cuda: bool) -> SharedBuffer:
        """A buffer for the checkpoint's parameters in the rollout dtype (`dtype`, as the engine is given it)."""
        shapes, vocab, checkpoint = hf_parameter_shapes(model_path)
        resolved = buffer_dtype(dtype, cpu=not cuda, checkpoint=checkpoint)
        size = torch.empty((), dtype=resolved).element_size()
        return cls(buffer_numel(shapes, size, vocab), resolved, cuda=cuda)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def close(self) -> None:
        """Drop this process's tensor and remove the /dev/shm file (servers that mapped it keep their mapping)."""
        self.tensor = None
        path, self.path = self.path, None
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
