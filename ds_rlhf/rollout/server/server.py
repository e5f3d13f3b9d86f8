"""The disaggregated rollout server: `python -m ds_rlhf.rollout.server.server`, started by RemoteVLLMEngine.

It hosts an in-process VLLMRolloutEngine ("uni" executor; "mp" for TP > 1, whose workers are then child processes),
built with the keywords of the client's 'start' (the vLLM engine options among them, checked in the adapter), and
answers the trainer's commands, pickled tuples over an authenticated local socket, until 'close'. Weights do not
come through the socket: on 'update' the vLLM workers receive the announced buckets over the weight group; on a
sidecar the trainer's CUDA buffer is mapped once ('init_ipc') and each 'update_ipc' loads the bucket it holds; with
`rollout.weight_transport vllm` the 'wt_*' commands make vLLM's weight-transfer calls (init / start / update /
finish): on a sidecar one 'wt_update' per chunk, carrying vLLM's IPC handle of the trainer's buffer; on other GPUs
(NCCL) 'wt_init' joins the trainer's NCCL group and one 'wt_update' receives the whole sync's broadcasts.
Every failure goes back to the client with its traceback instead of killing the server.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from multiprocessing.connection import Client

import torch

from ds_rlhf.rollout.vllm_adapter import preload
from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine
from ds_rlhf.rollout.vllm_mapping import update_info_nbytes
from ds_rlhf.rollout.weight_group import bucket_nbytes, plan_from_wire, unpack_bucket

_IPC: dict = {}  # the trainer's shared CUDA buffer (sidecar placement), mapped once


def _handle(engine, cmd: str, args: tuple):
    """One command; returns (engine, reply)."""
    if cmd == "start":
        model_path, kwargs = args
        tp = kwargs.get("tensor_parallel_size") or 1
        kwargs.setdefault("executor", "mp" if tp > 1 else "uni")
        engine = VLLMRolloutEngine(model_path, **kwargs)
        engine.placement = "disaggregated (server)"
        return engine, {"dtype": str(engine.weight_dtype), "world": tp, "version": engine.handle.version,
                        "start_seconds": engine.handle.start_seconds, "options": engine.handle.options}
    if engine is None:
        raise RuntimeError(f"command {cmd!r} before 'start'")
    if cmd == "generate_many":
        t0 = time.perf_counter()
        results = engine.handle.generate_many(args[0])
        engine._record_generate([s for r in results for s in r], time.perf_counter() - t0)
        seconds, tokens = engine.last_generate()
        return engine, {"rows": [[tuple(vars(s).values()) for s in r] for r in results], "seconds": seconds,
                        "tokens": tokens}
    if cmd == "logprobs":
        return engine, engine.logprobs(args[0])
    if cmd == "init_group":
        engine.handle.init_weight_group(*args)
        return engine, None
    if cmd == "update":
        t0 = time.perf_counter()
        engine.handle.receive_buckets(args[0])
        engine.reset_cache()
        nbytes = sum(m.numel * torch.empty((), dtype=m.dtype).element_size()
                     for bucket in plan_from_wire(args[0]) for m in bucket)
        engine._record_update(nbytes, time.perf_counter() - t0)
        return engine, {"load_seconds": time.perf_counter() - t0}
    if cmd == "init_ipc":  # the trainer's CUDA buffer, mapped into this process (sidecar on the same GPU)
        rebuild, rebuild_args = args[0]
        _IPC["buffer"] = rebuild(*rebuild_args)
        return engine, None
    if cmd == "update_ipc":
        t0 = time.perf_counter()
        metas = plan_from_wire(args[0])[0]
        engine.handle.load_weights(unpack_bucket(_IPC["buffer"][: bucket_nbytes(metas)], metas))
        torch.cuda.synchronize()  # our copies out of the shared buffer are done: the trainer may refill it
        engine._record_update(bucket_nbytes(metas), time.perf_counter() - t0)
        _IPC["load_seconds"] = _IPC.get("load_seconds", 0.0) + time.perf_counter() - t0
        return engine, None
    if cmd == "update_done":  # replies with this sync's loading time (every bucket's), then starts the next count
        engine.reset_cache()
        return engine, {"load_seconds": _IPC.pop("load_seconds", 0.0)}
    if cmd == "wt_init":  # vLLM's weight-transfer API (rollout.weight_transport vllm)
        engine.handle.transfer_init(args[0])
        return engine, None
    if cmd == "wt_start":
        engine.handle.transfer_start()
        return engine, None
    if cmd == "wt_update":  # IPC: one chunk, loaded (vLLM synchronises) before the reply; NCCL: every broadcast
        t0 = time.perf_counter()
        engine.handle.transfer_update(args[0])
        nbytes = update_info_nbytes(args[0])
        engine._record_update(nbytes, time.perf_counter() - t0)
        _IPC["load_seconds"] = _IPC.get("load_seconds", 0.0) + time.perf_counter() - t0
        return engine, None
    if cmd == "wt_finish":  # replies with this sync's loading time (every chunk's and the finish's)
        t0 = time.perf_counter()
        engine.handle.transfer_finish()
        engine.reset_cache()
        return engine, {"load_seconds": _IPC.pop("load_seconds", 0.0) + time.perf_counter() - t0}
    if cmd == "sleep":
        engine.sleep()
        return engine, {k: v for k, v in engine.stats().items() if k.startswith("sleep_")}
    if cmd == "wake":
        engine.wake(args[0])
        return engine, {k: v for k, v in engine.stats().items() if k.startswith("wake_")}
    if cmd == "stats":
        return engine, engine.stats()
    raise ValueError(f"unknown command {cmd!r}")


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
    engine = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "close":
            break
        try:
            engine, reply = _handle(engine, msg[0], msg[1:])
            conn.send(("ok", reply))
        except Exception:  # noqa: BLE001  every failure goes back to the client with its traceback
            conn.send(("error", traceback.format_exc()))
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.handle.close_weight_group()
        engine.close()


if __name__ == "__main__":
    serve()
