"""The trainer's end of vLLM's own weight-transfer engines (`rollout.weight_transport vllm`); the server's end is
`vllm_handle.VLLMHandle.transfer_*`.

Sidecar: the engine is built with `weight_transfer_config={"backend": "ipc"}` and weights go through vLLM's own
CUDA-IPC weight-transfer engine instead of ours. Server side: `LLM.init_weight_transfer_engine({"init_info": ...})`,
`start_weight_update()`, `update_weights({"update_info": ...})`, `finish_weight_update()`, the same calls and dict
forms in 0.26 and 0.32. Trainer side (`send_weights_through_vllm_ipc`) the two differ: 0.26 has the static
`IPCWeightTransferEngine.trainer_send_weights(iterator, {"send_mode": callable, "packed": True, ...})` (the caller
starts and finishes the update; `packed` travels in every update info); 0.32 has `IPCTrainerWeightTransferEngine`
(`trainer_init(IPCTrainerInitInfo(rank=0, packed=True, ...), client=..., source=WeightSource)` then `send_weights()`,
which drives init/start/update/finish through the client; `packed` travels in the init info). Our client forwards
each call to the rollout server(s) over their socket (`server/calls.py`). 0.26's `ipc_engine` imports `ray` and
`requests` at module top (used only by its 'ray' / 'http' send modes): without them the import fails and
`ipc_engine_module` says which package is missing.

Disaggregated server (its own GPUs): the engine is built with `weight_transfer_config={"backend": "nccl"}` and
`NCCLWeightSender` is the trainer's end of vLLM's NCCL weight-transfer engine (rank 0 of a group with the server's
1..tp workers; the same server-side calls; the trainer side differs between 0.26 and 0.32 as for IPC, see the class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.vllm_adapter import vllm_version
from ds_rlhf.rollout.vllm_mapping import nccl_update_info, nccl_wire, nccl_worker_init_info


def ipc_engine_module():
    """vLLM's `vllm.distributed.weight_transfer.ipc_engine`; RolloutError naming the missing package when it does not
    import (0.26 imports `ray` and `requests` at its top)."""
    try:
        from vllm.distributed.weight_transfer import ipc_engine
    except ModuleNotFoundError as e:
        raise RolloutError(f"rollout.weight_transport=vllm: vLLM's IPC weight-transfer engine needs the Python package "
                           f"{e.name!r}, which is not installed; install it or use --rollout.weight_transport own") \
            from None
    return ipc_engine


def send_weights_through_vllm_ipc(named_tensors: Iterable[tuple[str, torch.Tensor]], plan, client,
                                  buffer_bytes: int) -> None:
    """Send one weight update with vLLM's CUDA-IPC producer (packed: one reused buffer of `buffer_bytes` on this
    GPU). `client` has vLLM's `VLLMWeightSyncClient` methods (`init_weight_transfer_engine(dict)`,
    `start_weight_update()`, `update_weights(dict)`, `finish_weight_update()`); `update_weights` must return only
    after every server loaded the chunk, as the producer then overwrites the buffer. `plan` (our `BucketPlan`) is
    the stream's metadata, which 0.32's `WeightSource` reports."""
    mod = ipc_engine_module()
    if hasattr(mod, "IPCTrainerWeightTransferEngine"):  # 0.32: the trainer engine drives the client itself
        info = mod.IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=buffer_bytes)
        mod.IPCTrainerWeightTransferEngine.trainer_init(
            init_info=info, client=client, source=_weight_source(named_tensors, plan)).send_weights()
        return
    client.init_weight_transfer_engine({})  # 0.26: nothing to rendezvous; `packed` is in every update info
    client.start_weight_update()
    mod.IPCWeightTransferEngine.trainer_send_weights(iter(named_tensors), {
        "send_mode": lambda update: client.update_weights(dataclasses.asdict(update)), "packed": True,
        "packed_buffer_size_bytes": buffer_bytes})
    client.finish_weight_update()


def _weight_source(named_tensors: Iterable[tuple[str, torch.Tensor]] = (), plan=()):
    """A one-pass `WeightSource` (vLLM 0.32) over `named_tensors`, its metadata from `plan`; `refill` replaces both
    (vLLM's NCCL trainer engine takes its source once, at `trainer_init`, and replays it every `send_weights`)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def __init__(self):
            self.refill(named_tensors, plan)

        def refill(self, tensors, new_plan):
            self.tensors, self.plan = tensors, new_plan

        def metadata(self):
            return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for metas in self.plan for m in metas]

        def __iter__(self):
            return iter(self.tensors)

    return _BucketSource()


def nccl_engine_module():
    """vLLM's `vllm.distributed.weight_transfer.nccl_engine` (imports only torch and vLLM)."""
    from vllm.distributed.weight_transfer import nccl_engine

    return nccl_engine


class NCCLWeightSender:
    """The trainer's end of vLLM's NCCL weight-transfer engine (`rollout.weight_transport vllm`, disaggregated):
    rank 0 of a group with the server's vLLM workers (ranks 1..tp), on this process's current CUDA device.

    `client` has vLLM's `VLLMWeightSyncClient` methods plus `init_weight_transfer_engine_later(dict)` and
    `update_weights_later(dict)`, which send without waiting and return a `Pending` (`server/calls.py`): the
    server's `init_weight_transfer_engine` and `update_weights` block inside the same NCCL rendezvous / broadcasts
    as the trainer, so each must be in flight while the trainer makes its side of the call.

    vLLM 0.26: the static `NCCLWeightTransferEngine.trainer_init({...})` opens the trainer's endpoint (the caller
    has the workers join: 'wt_init' sent first, read after) and `trainer_send_weights(iterator, {"group": ...,
    "packed": True, ...})` broadcasts while the workers' `update_weights` (its update info carries `packed` and the
    buffer sizes) receives. vLLM 0.32: `NCCLTrainerWeightTransferEngine.trainer_init(NCCLTrainerInitInfo(...),
    client=, source=)` makes the same rendezvous (the workers' init from a thread of its own; `packed` travels in
    the init info), and `send_weights()` drives start / update (from a thread, beside its broadcast) / finish
    through the client. Both: packed chunks of `buffer_bytes` (vLLM cuts a chunk after the tensor that passes it),
    `NCCL_NUM_BUFFERS` in flight; `send` returns once the server loaded every tensor, before it finished (the
    client's `finish_weight_update` may leave that reply unread)."""

    def __init__(self, client, *, host: str, port: int, world_size: int, buffer_bytes: int) -> None:
        self.client, self.wire = client, nccl_wire(buffer_bytes)
        mod = nccl_engine_module()
        self._engine = self._group = None
        if hasattr(mod, "NCCLTrainerWeightTransferEngine"):  # 0.32: the trainer engine drives the client itself
            self._source = _weight_source()
            info = mod.NCCLTrainerInitInfo(rank=0, master_address=host, master_port=port, world_size=world_size,
                                           **self.wire)
            self._engine = mod.NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self._source)
            return
        if not hasattr(mod.NCCLWeightTransferEngine, "trainer_init"):
            raise RolloutError(f"rollout.weight_transport=vllm: vLLM {vllm_version()}'s NCCL weight-transfer engine "
                               "has no trainer side ds_rlhf knows; use --rollout.weight_transport own")
        joined = client.init_weight_transfer_engine_later(nccl_worker_init_info(host, port, world_size))
        self._group = mod.NCCLWeightTransferEngine.trainer_init(
            {"master_address": host, "master_port": port, "world_size": world_size})
        joined.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], plan) -> None:
        """One weight update of `named_tensors` (cast to and following `plan`, our `BucketPlan`)."""
        if self._engine is not None:  # 0.32
            self._source.refill(named_tensors, plan)
            self._engine.send_weights()
            return
        mod = nccl_engine_module()
        self.client.start_weight_update()
        received = self.client.update_weights_later(nccl_update_info(plan, self.wire))
        mod.NCCLWeightTransferEngine.trainer_send_weights(iter(named_tensors), {"group": self._group, **self.wire})
        received.result()  # the server loaded every chunk, so every broadcast landed on both ends
        if torch.cuda.is_available():  # the producer's own streams included: the buckets may be released now
            torch.cuda.synchronize()
        self.client.finish_weight_update()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = self._group = None

