"""How a sync's weights reach a rollout server: one class per transport, each owning its buffers, groups and the
replies it still owes, and `TRANSPORTS`, the registry the client picks one from when it connects.

| name | class | how the bytes move |
|---|---|---|
| `ipc` | `OwnIPC` | a sidecar on the trainer's GPU: one CUDA buffer of ours, mapped by every server once |
| `vllm_ipc` | `VLLMIPC` | a sidecar: vLLM's CUDA-IPC weight-transfer engine (`weight_transport vllm`) |
| `nccl` | `OwnNCCL` | a disaggregated server on other GPUs: our weight group over NCCL |
| `vllm_nccl` | `VLLMNCCL` | a disaggregated server: vLLM's NCCL weight-transfer engine (`weight_transport vllm`) |
| `gloo` | `OwnGloo` | a server on CPU (the CPU tests): our weight group over gloo |
| `shared` | `SharedWeights` | sidecars: engine weights are views of one trainer buffer (`weight_transport shared`) |

A new transport is a `ServerTransport` subclass (its `send_to`, and `engine_kwargs` or `prepare` / `attach` where
the server's engine must be built for it) and one line in `TRANSPORTS`; the client (`client.py`) then takes it by
name (`transport=`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ds_rlhf.distributed import free_port
from ds_rlhf.rollout.base import BucketPlan, Pending, RolloutError, TensorMeta, WeightTransport
from ds_rlhf.rollout.server.calls import RolloutServer, ServersWeightClient, all_of, command_all, send_all, slowest_load
from ds_rlhf.rollout.server.protocol import Command
from ds_rlhf.rollout.server.shared import SharedBuffer, check_plan
from ds_rlhf.rollout.server.watchdog import exit_if_server_fails
from ds_rlhf.rollout.shared_layout import Slot, slots_from_wire
from ds_rlhf.rollout.vllm_mapping import named_tensors_from_buckets, transfer_buffer_bytes
from ds_rlhf.rollout.vllm_transfer import NCCLWeightSender, send_weights_through_vllm_ipc
from ds_rlhf.rollout.weights.group import WeightGroup, bucket_nbytes, pack_bucket, plan_to_wire


class ServerTransport(WeightTransport):
    """Weights to the server of `server` (its client). `send` is what every trainer rank calls: rank 0 moves the
    buckets (`send_to`), the other ranks take part in ZeRO-3's collective gathers only. `owed`: the replies of the
    last update handed over without waiting, read by `settle` before the next update reuses what they still read."""

    shares_device = False  # True: one `send_to` serves several servers on the trainer's GPU at once (sidecars)

    def __init__(self, server: RolloutServer, dtype: torch.dtype) -> None:
        super().__init__()
        self.server, self.dtype = server, dtype
        self.owed: Pending | None = None
        self.state = None  # what `prepare` made (shared with the transports of later sidecars)

    @staticmethod
    def engine_kwargs(backend: str) -> dict:
        """Keywords the server's engine must be built with for this transport (`backend`: ipc, nccl or gloo)."""
        return {}

    @classmethod
    def prepare(cls, model_path: str, backend: str, engine_kwargs: dict, state=None):
        """Set up what the server's engine must be built with before it starts (it may add to `engine_kwargs`) and
        return the state this transport keeps (`attach`); `state`: the one an earlier server's transport made, to
        share it (several sidecars). Nothing by default."""
        return state

    def attach(self, state, info: dict) -> None:
        """Take the state `prepare` returned and the server's 'start' reply, once the server started."""
        self.state = state

    @abstractmethod
    def send_to(self, servers: Sequence[RolloutServer], buckets, plan: BucketPlan, *,
                wait: bool) -> tuple[int, Pending]:
        """Move one sync's buckets (announced by `plan`) to `servers` (this transport's server, or every sidecar
        where `shares_device`). With `wait=False` the last replies may be left unread in the returned `Pending`.
        Returns the bytes sent (once, however many servers) and that `Pending`."""

    def detach(self) -> None:  # noqa: B027  optional hook: most transports hold nothing the server must see go
        """Leave what needs the server still running (vLLM's NCCL endpoint); the client calls it before it tells
        the server to shut down, and `close` once the server has exited."""

    def settle(self) -> None:
        """Read the replies of the last update handed over without waiting, if still unread."""
        owed, self.owed = self.owed, None
        if owed is not None:
            owed.result()

    def send(self, buckets, plan: BucketPlan | None = None, *, wait: bool = True) -> Pending:
        """Defers only on one training rank (with several, a failure must reach every rank at once: each then gets
        the same empty acknowledgement, so reports keep one set of keys)."""
        server = self.server
        if not server.owner:
            if getattr(buckets, "zero3", True):
                for _ in buckets:  # ZeRO-3 gathers are collective: take part, send nothing
                    pass
            return Pending.done()
        if plan is None:
            buckets = [b for b in buckets if b]
            plan = [[TensorMeta(n, tuple(t.shape), self.dtype) for n, t in b] for b in buckets]
        t0 = time.perf_counter()
        nbytes, done = self.send_to([server], buckets, plan, wait=wait or not server.defers_replies)
        self.record(nbytes, time.perf_counter() - t0)
        return done if server.defers_replies else Pending.done()

    def load(self, named_tensors) -> None:
        """Bucket an arbitrary (name, tensor) stream here (held in memory), then send it like a sync. Rank 0 only
        sends; other ranks just consume their stream."""
        buckets, size = [[]], 0
        for name, t in named_tensors:
            if not self.server.owner:
                continue
            t = t.to(self.dtype)
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and size + nbytes > self.server.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += nbytes
        if self.server.owner:
            self.send(buckets)


class OwnIPC(ServerTransport):
    """Sidecar servers on the trainer's own GPU (NCCL refuses two ranks on one device): each bucket is packed once
    into a CUDA buffer of ours that every server maps through CUDA IPC once, then one message per bucket to each;
    the servers load from their views at the same time and answer after their copies finished, so the next bucket
    may overwrite the buffer. With `wait=False` the last bucket's replies (and the final 'update_done') are owed:
    the next update reads them before it writes the buffer again."""

    shares_device = True

    def __init__(self, server: RolloutServer, dtype: torch.dtype) -> None:
        super().__init__(server, dtype)
        self.buffer: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """The buffer, of at least `nbytes`, and whether it is new (then the servers have to map it)."""
        fresh = self.buffer is None or self.buffer.numel() < nbytes
        if fresh:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        return self.buffer, fresh

    def send_to(self, servers, buckets, plan, *, wait):
        nbytes, last = 0, len(plan) - 1
        self.settle()  # a server may still be copying out of the buffer
        owed: list[Pending] = []
        for i, (bucket, metas) in enumerate(zip(buckets, plan)):
            size = bucket_nbytes(metas)
            buffer, fresh = self._buffer(size)
            if fresh:
                command_all(servers, Command.INIT_IPC, reduce_tensor(buffer))
            pack_bucket([t for _, t in bucket], metas, out=buffer)
            torch.cuda.current_stream().synchronize()
            if wait or i < last:
                command_all(servers, Command.UPDATE_IPC, plan_to_wire([metas]))
            else:
                owed += send_all(servers, Command.UPDATE_IPC, plan_to_wire([metas]))
            nbytes += size
        if wait:
            return nbytes, Pending.done(slowest_load(command_all(servers, Command.UPDATE_DONE)))
        done = self.owed = all_of(owed + send_all(servers, Command.UPDATE_DONE))
        return nbytes, Pending(lambda: slowest_load(done.result()))

    def close(self) -> None:
        self.buffer = None


class VLLMIPC(ServerTransport):
    """`rollout.weight_transport vllm` on sidecars: every bucket through vLLM's CUDA-IPC weight-transfer engine
    (packed: one buffer of the largest bucket's size, refilled chunk by chunk; each chunk's handle goes to every
    server, which passes it to vLLM's `update_weights`), all servers loading the same chunk at once. vLLM's producer
    refills its buffer as soon as the send returns, so every chunk is acknowledged before the next; with
    `wait=False` only the final 'wt_finish' (vLLM's `finish_weight_update`, then the prefix cache reset) is owed."""

    shares_device = True

    @staticmethod
    def engine_kwargs(backend: str) -> dict:
        return {"weight_transfer_backend": backend}

    def send_to(self, servers, buckets, plan, *, wait):
        self.settle()  # the previous update's 'wt_finish', if not read yet
        client = ServersWeightClient(servers, defer_finish=not wait)
        send_weights_through_vllm_ipc(named_tensors_from_buckets(buckets, plan), plan, client,
                                      transfer_buffer_bytes(plan))
        nbytes, done = sum(bucket_nbytes(metas) for metas in plan), client.finished
        if wait:
            return nbytes, Pending.done(slowest_load(done.result()))
        self.owed = done
        return nbytes, Pending(lambda: slowest_load(done.result()))


class OwnNCCL(ServerTransport):
    """A disaggregated server's update over our weight group (rank 0 = this trainer rank, 1..N = the server's
    workers; joined on the first sync): the plan as one 'update' command, then each bucket flattened and broadcast
    on the group, bucket k+1 gathered and packed while bucket k is on the wire. With `wait=False` the server's
    acknowledgement is left unread in the returned `Pending` (the server answers in order, so a later command
    reads it first)."""

    backend = "nccl"

    def __init__(self, server: RolloutServer, dtype: torch.dtype) -> None:
        super().__init__(server, dtype)
        self.group: WeightGroup | None = None

    def _join(self) -> WeightGroup:
        if self.group is None:
            server = self.server
            port, world = free_port(), 1 + server.world
            reply = server.send_command(Command.INIT_GROUP, server.host, port, world, self.backend, server.timeout_s)
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
            self.group = WeightGroup(server.host, port, world, 0, self.backend, server.timeout_s, device)
            reply.result()
        return self.group

    def send_to(self, servers, buckets, plan, *, wait):
        group = self._join()
        done = self.server.send_command(Command.UPDATE, plan_to_wire(plan))
        nbytes, pending, n_sent = 0, None, 0
        for bucket, metas in zip(buckets, plan):
            names = [n for n, _ in bucket]
            if names != [m.name for m in metas]:
                raise RolloutError(f"bucket {n_sent} does not match the announced plan: {names[:3]} vs "
                                   f"{[m.name for m in metas][:3]}")
            buf = pack_bucket([t for _, t in bucket], metas)
            if pending is not None:
                pending.wait()  # overlap: gather/pack bucket k+1 while bucket k is on the wire
            pending = group.broadcast(buf)
            nbytes += buf.numel()
            n_sent += 1
        if pending is not None:
            pending.wait()
        if n_sent != len(plan):
            raise RolloutError(f"sent {n_sent} buckets but announced {len(plan)}")
        if wait:
            done.result()
        return nbytes, done

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


class OwnGloo(OwnNCCL):
    """A server on CPU: our weight group over gloo (what the CPU tests sync through)."""

    backend = "gloo"


class VLLMNCCL(ServerTransport):
    """`rollout.weight_transport vllm` on a disaggregated server (its own GPUs): the buckets go through vLLM's NCCL
    weight-transfer engine (`NCCLWeightSender`; packed broadcasts of chunks of the largest bucket's size). The
    first sync joins the trainer (rank 0) and the server's workers (ranks 1..tp) in vLLM's NCCL group, kept until
    `close`. A broadcast completes only once the server received it, so the trainer waits until the server loaded
    every tensor; with `wait=False` only the final 'wt_finish' is left unread in the returned `Pending`. vLLM's NCCL
    group has no timeout: the call runs under `watchdog.exit_if_server_fails`, which ends this process with a
    one-line error if the server exits or the call outlasts the client's timeout."""

    def __init__(self, server: RolloutServer, dtype: torch.dtype) -> None:
        super().__init__(server, dtype)
        self.client: ServersWeightClient | None = None
        self.sender: NCCLWeightSender | None = None

    @staticmethod
    def engine_kwargs(backend: str) -> dict:
        return {"weight_transfer_backend": backend}

    def send_to(self, servers, buckets, plan, *, wait):
        server = self.server
        with exit_if_server_fails([server.process], server.timeout_s, "weight update of the disaggregated server"):
            if self.sender is None:
                self.client = ServersWeightClient([server])
                self.sender = NCCLWeightSender(self.client, host=server.host, port=free_port(),
                                               world_size=1 + server.world, buffer_bytes=transfer_buffer_bytes(plan))
            self.client.defer_finish, self.client.finished = not wait, None
            self.sender.send(named_tensors_from_buckets(buckets, plan), plan)
        nbytes, done = sum(bucket_nbytes(metas) for metas in plan), self.client.finished
        if wait:
            return nbytes, Pending.done(slowest_load(done.result()))
        return nbytes, Pending(lambda: slowest_load(done.result()))

    def detach(self) -> None:
        sender, self.sender, self.client = self.sender, None, None
        if sender is not None:
            sender.close()

    def close(self) -> None:
        self.detach()


class SharedWeights(ServerTransport):
    """`rollout.weight_transport shared`: every server's vLLM parameters are views of one buffer the trainer owns
    (`shared.SharedBuffer`, mapped by each server at 'start', where our loader places the model in it:
    `vllm_shared.py`), so a sync writes each tensor into its slot of the layout the servers reported (cast to the
    buffer's dtype), synchronises the device and sends every server 'shared_update', which resets its prefix
    cache; the server loads nothing. The plan is checked first: a name with no slot, a shape unlike its slot's or a
    slot the sync leaves out is one RolloutError line naming the first such tensor, and nothing is written.
    With `wait=False` the 'shared_update' replies are owed, read before the next update.

    No server may read the buffer while it is written. The rollout service syncs only while the engine is idle
    (service.py; docs/ASYNC.md): synchronous mode collects the batch before training and publishing, async mode
    publishes only between collecting one batch and submitting the next, and an engine refuses a sync while a
    generation is in flight (`ShardedWeights.check_idle`). `rollout.overlap_sync` leaves replies unread (the load's
    acknowledgement, the canary's log-probs) that the server may still be working on; `send_to` therefore reads
    every server's owed replies first (`wait_replies`, which also refuses while a generation is in flight), so each
    server has answered every command sent before the first byte is written."""

    shares_device = True

    def __init__(self, server: RolloutServer, dtype: torch.dtype) -> None:
        super().__init__(server, dtype)
        self.slots: dict[str, Slot] = {}

    @property
    def shared(self) -> SharedBuffer | None:
        """The trainer's buffer (this transport's state, shared with the other sidecars' transports)."""
        return self.state

    @classmethod
    def prepare(cls, model_path, backend, engine_kwargs, state=None):
        if backend not in ("ipc", "gloo") or (engine_kwargs.get("tensor_parallel_size") or 1) > 1:
            raise RolloutError(f"rollout.weight_transport=shared maps one buffer of the trainer's into the servers "
                               f"on its own device: it needs sidecar servers with tensor parallel 1 (got weights "
                               f"over {backend}, tensor_parallel_size={engine_kwargs.get('tensor_parallel_size')})")
        shared = state or SharedBuffer.for_model(model_path, engine_kwargs.get("dtype", "auto"), cuda=backend == "ipc")
        engine_kwargs.update(dtype=shared.dtype_name, shared_weights=shared.rebuild)
        return shared

    def attach(self, state, info: dict) -> None:
        layout = slots_from_wire(info.get("shared_layout") or [])
        if not layout:
            raise RolloutError("rollout.weight_transport=shared: the server reported no layout of its weights")
        if state is not None:
            if state.layout is not None and state.layout != layout:
                raise RolloutError("rollout.weight_transport=shared: this server placed its weights in the shared "
                                   "buffer unlike the first server (same model and settings expected)")
            state.layout = layout
        super().attach(state, info)
        self.slots = {s.name: s for s in layout}

    def send_to(self, servers, buckets, plan, *, wait):
        self.settle()
        for server in servers:
            server.wait_replies()  # every command answered: no server reads the buffer while it is written
        check_plan(self.slots, plan)
        buffer, nbytes = self.shared.tensor, 0
        with torch.no_grad():
            for bucket in buckets:
                for name, t in bucket:
                    slot = self.slots.get(name)
                    if slot is None or tuple(t.shape) != slot.shape:
                        raise RolloutError(f"rollout.weight_transport=shared: {name} {list(t.shape)} is not in the "
                                           "announced plan")
                    buffer[slot.offset: slot.offset + slot.numel].view(slot.shape).copy_(t)
                    nbytes += slot.numel * buffer.element_size()
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()
        done = all_of(send_all(servers, Command.SHARED_UPDATE, nbytes))
        if wait:
            return nbytes, Pending.done(slowest_load(done.result()))
        self.owed = done
        return nbytes, Pending(lambda: slowest_load(done.result()))

    def close(self) -> None:
        shared, self.state = self.state, None
        if shared is not None:
            shared.close()


TRANSPORTS: dict[str, type[ServerTransport]] = {
    "ipc": OwnIPC,
    "vllm_ipc": VLLMIPC,
    "nccl": OwnNCCL,
    "vllm_nccl": VLLMNCCL,
    "gloo": OwnGloo,
    "shared": SharedWeights,
}


def transport_name(backend: str, choice: str) -> str:
    """The registry name for `rollout.weight_transport` `choice` (own / vllm / shared) over `backend` (ipc / nccl /
    gloo): shared is one transport whatever the backend (it refuses those it cannot map, `SharedWeights.prepare`)."""
    if choice == "shared":
        return "shared"
    return backend if choice == "own" else f"{choice}_{backend}"


def transport_class(name: str, backend: str, choice: str) -> type[ServerTransport]:
    """`TRANSPORTS[name]`, or a RolloutError saying which settings have none."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise RolloutError(f"rollout.weight_transport={choice} over {backend} has no weight transport "
                           f"{name!r} (known: {', '.join(sorted(TRANSPORTS))}); vLLM's weight-transfer engines need "
                           f"CUDA IPC or NCCL (weights over {backend} here): use --rollout.weight_transport own")
    return cls
