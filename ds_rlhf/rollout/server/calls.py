"""Calls to several rollout servers at once (`rollout.sidecar_engines`, `sharded.py`) over their `RemoteVLLMEngine`s:
send to all, then read every reply even after one failed, so no connection is left with a reply that a later call
would take for its own; the weight update through one shared CUDA-IPC buffer: ours (`update_through_ipc`) or
vLLM's IPC weight-transfer engine (`update_through_vllm_ipc`, `rollout.weight_transport vllm`); and a
disaggregated server's update over our weight group (`update_through_group`) or through vLLM's NCCL weight-transfer
engine (`update_through_vllm_nccl`)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Sequence
from typing import Protocol

import torch

from ds_rlhf.distributed import free_port
from ds_rlhf.rollout.base import BucketPlan, Pending, RolloutError
from ds_rlhf.rollout.server.protocol import Command
from ds_rlhf.rollout.server.watchdog import exit_if_server_fails
from ds_rlhf.rollout.vllm_mapping import named_tensors_from_buckets, transfer_buffer_bytes
from ds_rlhf.rollout.vllm_transfer import NCCLWeightSender, send_weights_through_vllm_ipc
from ds_rlhf.rollout.weights.group import WeightGroup, bucket_nbytes, pack_bucket, plan_to_wire


class RolloutServer(Protocol):
    """What these calls use of a rollout server's client (`client.RemoteVLLMEngine`)."""

    host: str
    world: int
    timeout_s: float
    weight_backend: str
    group: WeightGroup | None

    @property
    def process(self) -> subprocess.Popen | None: ...

    def send_command(self, *msg) -> Pending: ...

    def settle_owed(self) -> None: ...

    def owe(self, done: Pending) -> None: ...

    def ipc_buffer(self, nbytes: int) -> tuple[torch.Tensor, bool]: ...

    def vllm_weight_transfer(self, join) -> tuple[ServersWeightClient, NCCLWeightSender]: ...


def send_all(engines: Sequence[RolloutServer], *msg) -> list[Pending]:
    """Send `msg` to every server without waiting; one `Pending` reply each. When a send fails, the replies of the
    servers it reached are read first (so none is left for a later call to take for its own), then it raises."""
    sent = []
    for e in engines:
        try:
            sent.append(e.send_command(*msg))
        except (RolloutError, OSError) as err:
            for reply in sent:
                with contextlib.suppress(RolloutError):
                    reply.result()
            raise err if isinstance(err, RolloutError) else RolloutError(f"rollout server: {err}") from err
    return sent


def all_of(replies: Sequence[Pending]) -> Pending:
    """One `Pending` for several: `result()` reads every reply, even after one failed, then raises the first
    failure, else returns the replies' values in order."""
    def read():
        values, failure = [], None
        for reply in replies:
            try:
                values.append(reply.result())
            except RolloutError as err:
                failure = failure or err
        if failure is not None:
            raise failure
        return values

    return Pending(read)


def command_all(engines: Sequence[RolloutServer], *msg) -> list:
    """Send `msg` to every server, then read the reply of every server it reached, even after one failed (so no
    connection is left with an unread reply that the next call would take for its own); the first failure is
    raised once all replies are in. Returns the replies in the engines' order."""
    return all_of(send_all(engines, *msg)).result()


def update_through_ipc(engines: Sequence[RolloutServer], buckets, plan: BucketPlan, *,
                       wait: bool = True) -> tuple[int, Pending]:
    """Sidecar servers on the trainer's own GPU (NCCL refuses two ranks on one device): each bucket is packed once
    into a CUDA buffer of the first engine's that every server maps through CUDA IPC once, then one message per
    bucket to each; the servers load from their views at the same time and answer after their copies finished, so
    the next bucket may overwrite the buffer. With `wait=False` the last bucket's replies (and the final
    'update_done') are not awaited: the returned `Pending` reads them, and so does the next call here before it
    writes the buffer again (kept on the first engine). Returns the bytes sent (once, however many servers) and
    that `Pending` (done when `wait`)."""
    lead, nbytes, last = engines[0], 0, len(plan) - 1
    lead.settle_owed()  # a server may still be copying out of the buffer
    owed: list[Pending] = []
    for i, (bucket, metas) in enumerate(zip(buckets, plan)):
        size = bucket_nbytes(metas)
        buffer, fresh = lead.ipc_buffer(size)
        if fresh:
            from torch.multiprocessing.reductions import reduce_tensor

            command_all(engines, Command.INIT_IPC, reduce_tensor(buffer))
        pack_bucket([t for _, t in bucket], metas, out=buffer)
        torch.cuda.current_stream().synchronize()
        if wait or i < last:
            command_all(engines, Command.UPDATE_IPC, plan_to_wire([metas]))
        else:
            owed += send_all(engines, Command.UPDATE_IPC, plan_to_wire([metas]))
        nbytes += size
    if wait:
        return nbytes, Pending.done(slowest_load(command_all(engines, Command.UPDATE_DONE)))
    done = all_of(owed + send_all(engines, Command.UPDATE_DONE))
    lead.owe(done)  # read before the buffer is written again, whoever calls next
    return nbytes, Pending(lambda: slowest_load(done.result()))


class ServersWeightClient:
    """vLLM's `VLLMWeightSyncClient` methods over our rollout servers: each call goes to every server (commands
    'wt_init', 'wt_start', 'wt_update', 'wt_finish', `server.py`), which makes the same call on its `LLM`, and
    returns once every server answered (a chunk's 'wt_update' reply means its copy out of the trainer's buffer is
    done). With `defer_finish` the 'wt_finish' replies are not awaited: `finished` reads them. The `*_later` calls
    send without waiting and return a `Pending` of every reply (NCCL: the server's call blocks until the trainer
    joins the same rendezvous / broadcast, so it must be in flight before the trainer makes its side)."""

    def __init__(self, engines: Sequence[RolloutServer], *, defer_finish: bool = False) -> None:
        self.engines, self.defer_finish = list(engines), defer_finish
        self.finished: Pending | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        command_all(self.engines, Command.WT_INIT, dict(init_info))

    def init_weight_transfer_engine_later(self, init_info: dict) -> Pending:
        return all_of(send_all(self.engines, Command.WT_INIT, dict(init_info)))

    def update_weights_later(self, update_info: dict) -> Pending:
        return all_of(send_all(self.engines, Command.WT_UPDATE, dict(update_info)))

    def start_weight_update(self) -> None:
        command_all(self.engines, Command.WT_START)

    def update_weights(self, update_info: dict) -> None:
        command_all(self.engines, Command.WT_UPDATE, dict(update_info))

    def finish_weight_update(self) -> None:
        replies = send_all(self.engines, Command.WT_FINISH)
        self.finished = all_of(replies)
        if not self.defer_finish:
            self.finished.result()


def update_through_vllm_ipc(engines: Sequence[RolloutServer], buckets, plan: BucketPlan, *,
                            wait: bool = True) -> tuple[int, Pending]:
    """`rollout.weight_transport vllm`: the sidecar servers on the trainer's GPU get every bucket through vLLM's
    CUDA-IPC weight-transfer engine (packed: one buffer of the largest bucket's size, refilled chunk by chunk; each
    chunk's handle goes to every server, which passes it to vLLM's `update_weights`), all servers loading the same
    chunk at once. vLLM's producer refills its buffer as soon as the send returns, so every chunk is acknowledged
    before the next; with `wait=False` only the final 'wt_finish' (vLLM's `finish_weight_update`, then the prefix
    cache reset) is left unread: the returned `Pending` reads it, and so does the next update here first.
    Returns the bytes sent (once, however many servers) and that `Pending`."""
    lead = engines[0]
    lead.settle_owed()  # the previous update's 'wt_finish', if not read yet
    client = ServersWeightClient(engines, defer_finish=not wait)
    send_weights_through_vllm_ipc(named_tensors_from_buckets(buckets, plan), plan, client,
                                  transfer_buffer_bytes(plan))
    nbytes = sum(bucket_nbytes(metas) for metas in plan)
    done = client.finished
    if wait:
        return nbytes, Pending.done(slowest_load(done.result()))
    lead.owe(done)
    return nbytes, Pending(lambda: slowest_load(done.result()))


def update_through_group(engine: RolloutServer, buckets, plan: BucketPlan, *,
                         wait: bool = True) -> tuple[int, Pending]:
    """A disaggregated server's update over our weight group (joined on the first call): the plan as one 'update'
    command, then each bucket flattened and broadcast on the group, bucket k+1 gathered and packed while bucket k is
    on the wire. With `wait=False` the server's acknowledgement is left unread in the returned `Pending`.
    Returns the bytes sent and that `Pending`."""
    _join_group(engine)
    done = engine.send_command(Command.UPDATE, plan_to_wire(plan))
    nbytes, pending, n_sent = 0, None, 0
    for bucket, metas in zip(buckets, plan):
        names = [n for n, _ in bucket]
        if names != [m.name for m in metas]:
            raise RolloutError(f"bucket {n_sent} does not match the announced plan: {names[:3]} vs "
                               f"{[m.name for m in metas][:3]}")
        buf = pack_bucket([t for _, t in bucket], metas)
        if pending is not None:
            pending.wait()  # overlap: gather/pack bucket k+1 while bucket k is on the wire
        pending = engine.group.broadcast(buf)
        nbytes += buf.numel()
        n_sent += 1
    if pending is not None:
        pending.wait()
    if n_sent != len(plan):
        raise RolloutError(f"sent {n_sent} buckets but announced {len(plan)}")
    if wait:
        done.result()
    return nbytes, done


def _join_group(engine: RolloutServer) -> None:
    """The weight group of `engine` and its server's workers (rank 0 = this trainer rank, 1..N = the workers)."""
    if engine.group is not None:
        return
    port, world = free_port(), 1 + engine.world
    reply = engine.send_command(Command.INIT_GROUP, engine.host, port, world, engine.weight_backend, engine.timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if engine.weight_backend == "nccl" else None
    engine.group = WeightGroup(engine.host, port, world, 0, engine.weight_backend, engine.timeout_s, device)
    reply.result()


def update_through_vllm_nccl(engine: RolloutServer, buckets, plan: BucketPlan, *,
                             wait: bool = True) -> tuple[int, Pending]:
    """`rollout.weight_transport vllm` on a disaggregated server (its own GPUs): the buckets go through vLLM's NCCL
    weight-transfer engine (`NCCLWeightSender`; packed broadcasts of chunks of the largest bucket's size). The
    first call joins the trainer (rank 0) and the server's workers (ranks 1..tp) in vLLM's NCCL group. A broadcast
    completes only once the server received it, so the trainer waits until the server loaded every tensor; with
    `wait=False` only the final 'wt_finish' (vLLM's `finish_weight_update`, then the prefix cache reset) is left
    unread: the returned `Pending` reads it (the server answers in order, so a later command reads it first).
    vLLM's NCCL group has no timeout: the call runs under `watchdog.exit_if_server_fails`, which ends this process
    with a one-line error if the server exits or the call outlasts the client's timeout.
    Returns the bytes sent and that `Pending`."""
    def join(server: RolloutServer) -> tuple[ServersWeightClient, NCCLWeightSender]:
        client = ServersWeightClient([server])
        return client, NCCLWeightSender(client, host=server.host, port=free_port(), world_size=1 + server.world,
                                        buffer_bytes=transfer_buffer_bytes(plan))

    with exit_if_server_fails([engine.process], engine.timeout_s, "weight update of the disaggregated server"):
        client, sender = engine.vllm_weight_transfer(join)
        client.defer_finish, client.finished = not wait, None
        sender.send(named_tensors_from_buckets(buckets, plan), plan)
    nbytes = sum(bucket_nbytes(metas) for metas in plan)
    done = client.finished
    if wait:
        return nbytes, Pending.done(slowest_load(done.result()))
    return nbytes, Pending(lambda: slowest_load(done.result()))


def slowest_load(replies: list) -> dict:
    """The servers' acknowledgements of one weight update as one: the slowest server's `load_seconds`."""
    seconds = [r["load_seconds"] for r in replies if isinstance(r, dict) and r.get("load_seconds") is not None]
    return {"load_seconds": max(seconds)} if seconds else {}
