"""The disaggregated rollout server: `python -m ds_rlhf.rollout.server.server`, started by RemoteVLLMEngine.

It hosts an in-process VLLMRolloutEngine ("uni" executor; "mp" for TP > 1, whose workers are then child processes),
built with the keywords of the client's 'start' (the vLLM engine options among them, checked in the adapter), and
answers the trainer's commands (`protocol.py`), pickled tuples over an authenticated local socket, until 'close':
`ServerSession` holds the engine and what the server keeps between commands, one method per command. Weights do not
come through the socket: on 'update' the vLLM workers receive the announced buckets over the weight group; on a
sidecar the trainer's CUDA buffer is mapped once ('init_ipc') and each 'update_ipc' loads the bucket it holds; with
`rollout.weight_transport vllm` the 'wt_*' commands make vLLM's weight-transfer calls (init / start / update /
finish): on a sidecar one 'wt_update' per chunk, carrying vLLM's IPC handle of the trainer's buffer; on other GPUs
(NCCL) 'wt_init' joins the trainer's NCCL group and one 'wt_update' receives the whole sync's broadcasts. With
`rollout.weight_transport shared` the 'start' message carries the trainer's weight buffer (`shared_weights`): the
server maps it and builds its engine with our loader (`vllm_shared.py`), whose parameters are views of it; a sync
is the trainer writing into the buffer, then 'shared_update', which resets the prefix cache.
Every failure goes back to the client with its traceback instead of killing the server.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from multiprocessing.connection import Client

import torch

from ds_rlhf.rollout.server.protocol import ERROR, OK, Command
from ds_rlhf.rollout.vllm_adapter import preload
from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine
from ds_rlhf.rollout.vllm_mapping import update_info_nbytes
from ds_rlhf.rollout.weights.group import bucket_nbytes, plan_from_wire, unpack_bucket


class ServerSession:
    """The server's state between commands (its engine, once 'start' built it; the trainer's shared CUDA buffer,
    mapped once on a sidecar; the loading time of the sync under way) and one method per command of
    `protocol.Command`, taking that command's arguments (`protocol.MESSAGES`) and returning its reply."""

    def __init__(self) -> None:
        self.engine: VLLMRolloutEngine | None = None
        self.ipc_buffer: torch.Tensor | None = None  # the trainer's buffer (`init_ipc`, or shared weights)
        self.shared = False  # the engine's weights are views of the trainer's buffer (rollout.weight_transport shared)
        self.load_seconds = 0.0  # this sync's loading time so far (IPC buckets, vLLM's chunks)
        self.handlers = {Command.START: self.start, Command.GENERATE_MANY: self.generate_many,
                         Command.LOGPROBS: self.logprobs, Command.INIT_GROUP: self.init_group,
                         Command.UPDATE: self.update, Command.INIT_IPC: self.init_ipc,
                         Command.UPDATE_IPC: self.update_ipc, Command.UPDATE_DONE: self.update_done,
                         Command.WT_INIT: self.wt_init, Command.WT_START: self.wt_start,
                         Command.WT_UPDATE: self.wt_update, Command.WT_FINISH: self.wt_finish,
                         Command.SHARED_UPDATE: self.shared_update, Command.SLEEP: self.sleep,
                         Command.WAKE: self.wake, Command.STATS: self.stats}

    def handle(self, cmd: str, args: tuple):
        """One command; returns its reply."""
        if cmd != Command.START and self.engine is None:
            raise RuntimeError(f"command {cmd!r} before 'start'")
        handler = self.handlers.get(cmd)
        if handler is None:
            raise ValueError(f"unknown command {cmd!r}")
        return handler(*args)

    def _loaded(self, nbytes: int, t0: float) -> None:
        """Count one loaded part of a sync (the engine's update stats, this sync's loading time)."""
        self.engine.weights.record(nbytes, time.perf_counter() - t0)
        self.load_seconds += time.perf_counter() - t0

    def _sync_done(self, extra_s: float = 0.0) -> dict:
        """This sync's loading time, then the next sync's count starts."""
        seconds, self.load_seconds = self.load_seconds + extra_s, 0.0
        return {"load_seconds": seconds}

    def start(self, model_path: str, engine_kwargs: dict) -> dict:
        tp = engine_kwargs.get("tensor_parallel_size") or 1
        engine_kwargs.setdefault("executor", "mp" if tp > 1 else "uni")
        shared = engine_kwargs.pop("shared_weights", None)  # (function, arguments) that map the trainer's buffer
        self.shared = shared is not None
        if shared is not None:
            rebuild_fn, rebuild_args = shared
            self.ipc_buffer = engine_kwargs["shared_buffer"] = rebuild_fn(*rebuild_args)
        engine = self.engine = VLLMRolloutEngine(model_path, **engine_kwargs)
        engine.placement = "disaggregated (server)"
        info = {"dtype": str(engine.weights.dtype), "world": tp, "version": engine.handle.version,
                "start_seconds": engine.handle.start_seconds, "options": engine.handle.options}
        if shared is not None:
            report = engine.handle.shared_report()
            if report["outside_bytes"]:
                raise RuntimeError(f"shared weights: {report['outside_bytes']} bytes of vLLM parameters lie outside "
                                   "the trainer's buffer after start-up (vLLM replaced them after loading)")
            info["shared_layout"] = report["layout"]
        return info

    def shared_update(self, nbytes: int) -> dict:
        """The trainer wrote a sync into the buffer our parameters are views of: only the prefix cache is stale."""
        t0 = time.perf_counter()
        self.engine.handle.reset_prefix_cache()
        self.engine.weights.record(nbytes, time.perf_counter() - t0)
        return {"load_seconds": time.perf_counter() - t0}

    def generate_many(self, groups) -> dict:
        t0 = time.perf_counter()
        results = self.engine.handle.generate_many(groups)
        self.engine.record_generate([s for r in results for s in r], time.perf_counter() - t0)
        seconds, tokens = self.engine.last_generate()
        return {"rows": [[tuple(vars(s).values()) for s in r] for r in results], "seconds": seconds, "tokens": tokens}

    def logprobs(self, sequences):
        return self.engine.logprobs(sequences)

    def init_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.engine.handle.init_weight_group(host, port, world_size, backend, timeout_s)

    def update(self, wire_plan) -> dict:
        t0 = time.perf_counter()
        handle = self.engine.handle
        handle.begin_reload()  # FP8 rollouts: the whole sync in one reload (no-op otherwise)
        try:
            handle.receive_buckets(wire_plan)
        finally:
            handle.end_reload()
        handle.reset_prefix_cache()
        nbytes = sum(m.numel * torch.empty((), dtype=m.dtype).element_size()
                     for bucket in plan_from_wire(wire_plan) for m in bucket)
        self.engine.weights.record(nbytes, time.perf_counter() - t0)
        return {"load_seconds": time.perf_counter() - t0}

    def init_ipc(self, rebuild) -> None:
        """The trainer's shared buffer, mapped into this process by `rebuild` (a function and its arguments): its
        CUDA buffer on a sidecar on the same GPU (`reduce_tensor`), or any other buffer a transport shares."""
        rebuild_fn, rebuild_args = rebuild
        self.ipc_buffer = rebuild_fn(*rebuild_args)

    def update_ipc(self, wire_plan) -> None:
        t0 = time.perf_counter()
        metas = plan_from_wire(wire_plan)[0]
        self.engine.handle.begin_reload()  # FP8 rollouts: opened by a sync's first bucket, closed by update_done
        self.engine.handle.load_weights(unpack_bucket(self.ipc_buffer[: bucket_nbytes(metas)], metas))
        if self.ipc_buffer.is_cuda:
            torch.cuda.synchronize()  # our copies out of the shared buffer are done: the trainer may refill it
        self._loaded(bucket_nbytes(metas), t0)

    def update_done(self) -> dict:
        """Replies with this sync's loading time (every bucket's and the reload's close), then starts the next
        count."""
        t0 = time.perf_counter()
        self.engine.handle.end_reload()
        self.engine.handle.reset_prefix_cache()
        return self._sync_done(time.perf_counter() - t0)

    def wt_init(self, init_info: dict) -> None:  # vLLM's weight-transfer API (rollout.weight_transport vllm)
        self.engine.handle.transfer_init(init_info)

    def wt_start(self) -> None:
        self.engine.handle.transfer_start()

    def wt_update(self, update_info: dict) -> None:
        """IPC: one chunk, loaded (vLLM synchronises) before the reply; NCCL: every broadcast."""
        t0 = time.perf_counter()
        self.engine.handle.transfer_update(update_info)
        self._loaded(update_info_nbytes(update_info), t0)

    def wt_finish(self) -> dict:
        """Replies with this sync's loading time (every chunk's and the finish's)."""
        t0 = time.perf_counter()
        self.engine.handle.transfer_finish()
        self.engine.handle.reset_prefix_cache()
        return self._sync_done(time.perf_counter() - t0)

    def sleep(self) -> dict:
        self.engine.sleep()
        return {k: v for k, v in self.engine.stats().items() if k.startswith("sleep_")}

    def wake(self, tags) -> dict:
        self.engine.wake(tags)
        return {k: v for k, v in self.engine.stats().items() if k.startswith("wake_")}

    def stats(self) -> dict:
        out = self.engine.stats()
        if self.shared:  # shared weights: parameter bytes outside the trainer's buffer (0 while it holds)
            out["shared_outside_bytes"] = self.engine.handle.shared_report()["outside_bytes"]
        return out

    def close(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.handle.close_weight_group()
            self.engine.close()


def _preload() -> None:
    """Import vLLM before connecting: the client accepts this server's connection only when its turn comes
    (`process.py`), so the import runs while it still builds another server's engine. An import that fails
    here fails again in 'start', whose traceback goes back to the client."""
    t0 = time.perf_counter()
    try:
        preload()
    except Exception as e:  # noqa: BLE001  reported by 'start' (see above)
        print(f"[rollout server] importing vLLM failed ({type(e).__name__}); 'start' will say why", flush=True)
        return
    print(f"[rollout server] vLLM imported in {time.perf_counter() - t0:.1f}s, before connecting", flush=True)


def serve() -> None:
    host, port = os.environ["DS_RLHF_ROLLOUT_ADDR"].rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop("DS_RLHF_ROLLOUT_KEY"))
    _preload()
    conn = Client((host, int(port)), authkey=key)
    session = ServerSession()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == Command.CLOSE:
            break
        try:
            conn.send((OK, session.handle(msg[0], msg[1:])))
        except Exception:  # noqa: BLE001  every failure goes back to the client with its traceback
            conn.send((ERROR, traceback.format_exc()))
    session.close()

if __name__ == "__main__":
    serve()
