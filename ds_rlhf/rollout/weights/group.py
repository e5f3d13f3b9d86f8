"""A dedicated torch.distributed group for shipping weights to a disaggregated rollout engine, and bucket packing.

Why a standalone group: the trainer's default group (DeepSpeed's) does not contain the vLLM processes, and vLLM's
workers have their own default group, so neither can be reused. Each side builds a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (GPU) object directly on a shared TCPStore; rank 0 is the sender (trainer rank 0), ranks 1..N are
the rollout workers. Nothing is registered globally, so it never interferes with either side's collectives. With a
loopback host (the rollout server on the trainer's machine) the store listens on that address only.

Wire format: a bucket is a list of tensors of one dtype, flattened into one contiguous buffer and broadcast as raw
bytes (a uint8 view: the same code path for every dtype and backend). Receivers already know each tensor's
name/shape/dtype from the sync's single control message (the bucket plan), so one broadcast per bucket suffices.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ds_rlhf.distributed import loopback_store, unpinned
from ds_rlhf.rollout.base import TensorMeta

GROUP_PREFIX = "ds_rlhf_weights"


class WeightGroup:
    """One member of the sender + receivers group; `broadcast` is always rooted at rank 0 (the trainer)."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
                 timeout_s: float = 600.0, device: torch.device | str | None = None) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if _is_loopback(host):  # the trainer and the rollout server on one host: the store listens there only
            self._store = loopback_store(port, world_size, rank == 0, timeout, host=host)
        else:
            self._store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        store = dist.PrefixStore(GROUP_PREFIX, self._store)
        if backend == "gloo":
            with contextlib.nullcontext() if _is_loopback(host) else unpinned():  # gloo reachable from that host
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("weight group backend 'nccl' needs a CUDA build of torch; use 'gloo' on CPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown weight group backend {backend!r} (expected 'gloo' or 'nccl')")

    def broadcast(self, buf: torch.Tensor):
        """Broadcast `buf` (a uint8 buffer) from rank 0 in place; returns the work handle (call `.wait()`)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([buf], opts)

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):  # a half-open group must not mask the real error
                pg.shutdown()
        self._store = None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: torch's store, as the launcher would
        return False


def bucket_nbytes(metas: Sequence[TensorMeta]) -> int:
    return sum(m.numel * _itemsize(m.dtype) for m in metas)


def pack_bucket(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta],
                device: torch.device | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flatten tensors (cast to the plan's dtype) into one uint8 buffer, checking them against the plan; into the
    front of `out` (a larger uint8 buffer, e.g. one shared with the rollout process) when given."""
    if len(tensors) != len(metas):
        raise RuntimeError(f"bucket has {len(tensors)} tensors but the plan announced {len(metas)}")
    dtype = metas[0].dtype
    device = device or tensors[0].device
    numel = sum(m.numel for m in metas)
    if out is not None:
        flat = out[: numel * _itemsize(dtype)].view(dtype)
    else:
        flat = torch.empty(numel, dtype=dtype, device=device)
    offset = 0
    for t, m in zip(tensors, metas):
        if tuple(t.shape) != tuple(m.shape):
            raise RuntimeError(f"{m.name}: shape {tuple(t.shape)} differs from the announced {m.shape}")
        flat[offset:offset + m.numel].copy_(t.reshape(-1))
        offset += m.numel
    return flat.view(torch.uint8)


def unpack_bucket(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of one received uint8 buffer, in plan order (no copies)."""
    flat = buf.view(metas[0].dtype)
    out, offset = [], 0
    for m in metas:
        out.append((m.name, flat[offset:offset + m.numel].view(m.shape)))
        offset += m.numel
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_from_str(name: str) -> torch.dtype:
    """'torch.bfloat16' or 'bfloat16' -> torch.bfloat16 (plans cross process boundaries as plain strings)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def plan_to_wire(plan: Sequence[Sequence[TensorMeta]]) -> list[list[tuple[str, list[int], str]]]:
    return [[(m.name, list(m.shape), str(m.dtype)) for m in bucket] for bucket in plan]


def plan_from_wire(wire) -> list[list[TensorMeta]]:
    return [[TensorMeta(n, tuple(s), dtype_from_str(d)) for n, s, d in bucket] for bucket in wire]
