"""Disaggregated vLLM rollout engine: vLLM on its own devices, in its own process, weights over a weight group.

Build it on every trainer rank (like the colocated engine). Trainer rank 0 starts the server
(`python -m ds_rlhf.rollout.server.server`, see there) and talks to it over an authenticated local socket; other
ranks are thin proxies: `generate` / `score` gather every rank's requests to rank 0 over the trainer's default group,
rank 0 sends them to vLLM as one batch and scatters the results back. So a data-parallel trainer calls the same
API on every rank whatever the placement (`generate` / `score` are collective here).

A sync (only rank 0 talks to vLLM; other ranks drain the ZeRO-3 gathers):
  rank 0 -> server: ("update", plan)      the one control message: names/shapes/dtypes of every bucket
  rank 0: per bucket: flatten, one broadcast on the weight group (gloo on CPU, NCCL on GPU)
  server: collective_rpc -> each vLLM worker receives each bucket and calls model.load_weights on views of it
  server -> rank 0: ("ok", None)          after vLLM's prefix cache was reset
The server answers every command in the order it came, so replies are read in that order (`send_command` returns a
`Pending` per command; reading one reads and keeps those before it). That lets a single-rank trainer hand weights
over without waiting (`weights.send(wait=False)`): its next generation request queues behind the load, and the
load's acknowledgement is read, at the latest, when that generation is collected.
How the weights move is the client's transport (`weights`), chosen once when it connects from
`transports.TRANSPORTS` by the weight backend and `rollout.weight_transport` (or by name, `transport=`): our weight
group (rank 0 = trainer rank 0, 1..N = vLLM workers, created on the first sync), vLLM's NCCL weight-transfer engine
over the same ranks (the server's engine is built with `weight_transfer_config={"backend": "nccl"}`), or on a
sidecar a CUDA-IPC buffer. Server errors come back as RolloutError with the server's traceback; a dead server is
reported with its exit code.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence

import torch

from ds_rlhf.distributed import multi_rank
from ds_rlhf.rollout.base import (
    Pending,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    RolloutTicket,
    SamplingSpec,
)
from ds_rlhf.rollout.server.process import ServerProcess
from ds_rlhf.rollout.server.protocol import ERROR, Command
from ds_rlhf.rollout.server.rank_relay import gather_to_owner, scatter_from_owner
from ds_rlhf.rollout.server.transports import transport_class, transport_name


class ConnectionLost(RolloutError):
    """The server stopped answering (it exited, timed out, or closed the connection): every reply still owed is
    lost with it, so each unread `Pending` raises this."""


class RemoteVLLMEngine(RolloutEngine):
    backend = "vllm"
    placement = "disaggregated"

    def __init__(self, model_path: str, *, devices: Sequence[int] | None = None, weight_backend: str | None = None,
                 timeout_s: float = 600.0, startup_timeout_s: float = 900.0, bucket_bytes: int = 1 << 30,
                 log_path: str | None = None, host: str = "127.0.0.1", process: ServerProcess | None = None,
                 transport: str | None = None, server_env: Mapping[str, str] | None = None,
                 transport_state=None, **engine_kwargs) -> None:
        super().__init__()
        self.timeout_s, self.bucket_bytes, self.host = timeout_s, bucket_bytes, host
        # ipc: a sidecar on the trainer's GPU (devices == [this GPU]); nccl: other GPUs; gloo: CPU
        self.weight_backend = weight_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # own: our IPC buffer / weight group; vllm: vLLM's weight-transfer engine, CUDA IPC on the sidecar, NCCL on
        # other GPUs; `transport` names a registered one (`transports.TRANSPORTS`) instead
        choice = engine_kwargs.get("weight_transport", "own")
        self.transport = transport or transport_name(self.weight_backend, choice)
        chosen = transport_class(self.transport, self.weight_backend, choice)
        engine_kwargs.update(chosen.engine_kwargs(self.weight_backend))  # to 'start' with the other engine keywords
        self._in_flight = False
        self._generation: Pending | None = None  # the reply to the generation in flight
        self._unread: deque[Pending] = deque()  # replies not read yet, oldest first (the server answers in order)
        self._lost: ConnectionLost | None = None  # set once the connection broke: no later reply can be trusted
        self._conn = self._proc = self._listener = self._log = None
        self._d = torch.distributed if multi_rank() else None
        self.owner = self._d is None or self._d.get_rank() == 0
        info = state = None
        if self.owner:  # a server spawned ahead (`process.spawn_servers`) or one of its own
            # what the server's engine is built around (shared weights: the trainer's buffer; `transport_state`: the
            # one an earlier sidecar's transport made, `factory._sharded`)
            state = chosen.prepare(str(model_path), self.weight_backend, engine_kwargs, transport_state)
            process = process or ServerProcess(devices=devices, log_path=log_path, host=host, extra_env=server_env)
            info = self._start(process, model_path, startup_timeout_s, engine_kwargs)
        if self._d is not None:
            box = [info]
            self._d.broadcast_object_list(box, src=0)
            info = box[0]
        if "error" in info:
            if state is not None and state is not transport_state and hasattr(state, "close"):
                state.close()  # made for this server only
            raise RolloutError(info["error"])
        self.world = info["world"]
        self.weights = chosen(self, getattr(torch, info["dtype"].removeprefix("torch.")))
        self.weights.attach(state, info)
        self._c.extra.update(vllm_version=info["version"], start_seconds=info["start_seconds"],
                             vllm_options=info.get("options"))

    def _start(self, process: ServerProcess, model_path, startup_timeout_s, engine_kwargs) -> dict:
        """Take `process` over, wait for its connection and have it build its engine."""
        self._listener, self._proc, self._log = process.listener, process.proc, process.log
        try:
            deadline = time.monotonic() + startup_timeout_s
            self._conn = process.connect(startup_timeout_s)
            self._conn.send((Command.START, str(model_path), engine_kwargs))
            info = self._recv(max(1.0, deadline - time.monotonic()))
        except RolloutError as e:
            self.close()
            return {"error": str(e)}  # every rank raises it, instead of ranks > 0 waiting forever
        except BaseException:  # e.g. Ctrl-C while the server starts: stop it before going
            self.close()
            raise
        self._c.extra["server_pid"] = self._proc.pid
        return info

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _recv(self, timeout: float | None = None):
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            while not self._conn.poll(1.0):
                if self._proc.poll() is not None:
                    raise ConnectionLost(f"rollout server exited with code {self._proc.returncode}")
                if time.monotonic() > deadline:
                    raise ConnectionLost(f"rollout server did not answer within {timeout:.0f}s")
            status, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            raise ConnectionLost(f"rollout server connection lost: {type(e).__name__}: {e}") from e
        if status == ERROR:
            raise RolloutError(f"rollout server failed:\n{payload}")
        return payload

    def send_command(self, *msg) -> Pending:
        """Send one command to the server without waiting; `result()` of the returned `Pending` reads its reply
        (RolloutError with the server's traceback on failure), after reading and keeping every earlier unread
        reply for its own `Pending`. Several servers can then work at once (`sharded.py`). Single-rank use only:
        no gather over the trainer's ranks."""
        if self._conn is None:
            raise RolloutError("rollout engine is closed")
        if self._lost is not None:
            raise self._lost
        try:
            self._conn.send(msg)
        except OSError as e:  # the server closed its end (it exited, or broke): nothing owed will come either
            self._lose(ConnectionLost(f"rollout server connection lost: {type(e).__name__}: {e}"))
            raise self._lost from e
        reply = Pending(lambda: self._read_until(reply))
        self._unread.append(reply)
        return reply

    def _read_until(self, reply: Pending):
        """Read replies in order up to `reply`'s; each earlier one is kept in its own `Pending`. A lost connection
        fails every reply still owed (a late answer must never be taken for the next command's)."""
        while self._unread:
            head = self._unread.popleft()
            try:
                state = ("ok", self._recv())
            except ConnectionLost as e:
                self._lose(e)
                state = ("error", e)
            except RolloutError as e:  # the server's own failure of this command: the stream is still in step
                state = ("error", e)
            if head is reply:
                if state[0] == "error":
                    raise state[1]
                return state[1]
            head.fill(state)
            if reply.ready:  # failed with the connection, while an earlier reply was read
                reply.result()
        raise RolloutError("no reply is pending for that command (read already, or sent to another server)")

    def _lose(self, error: ConnectionLost) -> None:
        self._lost = error
        while self._unread:
            self._unread.popleft().fill(("error", error))

    def _call(self, *msg):
        return self.send_command(*msg).result()

    def _check_idle(self) -> None:
        if self._in_flight:
            raise RolloutError("a generation is in flight: collect it before any other call")

    def wait_replies(self) -> None:
        """Wait until the server answered every command sent (each reply kept for whoever reads it, a failure
        too); refused while a generation is in flight. The server then runs nothing until the next command."""
        self._check_idle()
        if self._unread:
            with contextlib.suppress(RolloutError):
                self._unread[-1].result()

    def _collective(self, item, run):
        """Gather every rank's `item` to rank 0, `run(items)` there (a list per rank), scatter each rank its part."""
        self._check_idle()
        items = gather_to_owner(self._d, self.owner, item)
        return scatter_from_owner(self._d, self.owner, lambda: run(items))

    @property
    def process(self) -> subprocess.Popen | None:
        """The server process (None on ranks > 0 and once closed)."""
        return self._proc

    # ---- RolloutEngine ----------------------------------------------------------------------------------------
    @staticmethod
    def _per_rank(reply: dict) -> list[tuple[list, float, int]]:
        """The server's generate_many reply as each rank's (rows, the server's seconds and tokens for the call)."""
        return [(rows, reply["seconds"], reply["tokens"]) for rows in reply["rows"]]

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        rows, seconds, tokens = self._collective(
            (prompts, spec), lambda groups: self._per_rank(self._call(Command.GENERATE_MANY, groups)))
        samples = [RolloutSample(*s) for s in rows]
        self.record_generate(samples, seconds, tokens)
        return samples

    def submit(self, prompts: list[list[int]], spec: SamplingSpec) -> RolloutTicket:
        """Send the request and return: the server generates while the trainer trains. Collective like `generate`
        (every rank's prompts go to rank 0 now; the results come back in `collect`)."""
        if self._in_flight:
            raise RolloutError("a generation is already in flight: collect it first")
        t0 = time.perf_counter()
        groups = gather_to_owner(self._d, self.owner, (prompts, spec))
        if self.owner:
            self._generation = self.send_command(Command.GENERATE_MANY, groups)
        self._in_flight = True
        return RolloutTicket(pending=groups is not None, started=t0)

    def collect(self, ticket: RolloutTicket) -> list[RolloutSample]:
        if ticket.samples is not None:
            return ticket.samples
        if not self._in_flight:
            raise RolloutError("no generation in flight to collect")
        self._in_flight = False
        reply, self._generation = self._generation, None
        run = (lambda: self._per_rank(reply.result())) if self.owner else None
        rows, seconds, tokens = scatter_from_owner(self._d, self.owner, run)
        samples = [RolloutSample(*s) for s in rows]
        self.record_generate(samples, seconds, tokens)  # the server's own time: with overlap the wait is less
        return samples

    @property
    def defers_replies(self) -> bool:
        return self._d is None  # one rank: a failure read later reaches the only rank there is

    def logprobs_replicas_later(self, sequences: list[list[int]]) -> Pending:
        if not self.defers_replies:
            return super().logprobs_replicas_later(sequences)  # collective: every rank now
        self._check_idle()
        reply = self.send_command(Command.LOGPROBS, sequences)
        return Pending(lambda: [reply.result()])

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        def run(groups):
            flat = self._call(Command.LOGPROBS, [s for g in groups for s in g])
            bounds = [0]
            for g in groups:
                bounds.append(bounds[-1] + len(g))
            return [flat[a:b] for a, b in zip(bounds, bounds[1:])]

        return self._collective(sequences, run)

    def sleep(self) -> None:
        if self.owner:
            self._c.extra.update(self._call(Command.SLEEP))
        self.sleeping = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Ask the server to wake only when this engine was put to sleep: a call on an awake one would read
        every reply still owed (a weight update handed over without waiting) just to do nothing."""
        if not self.sleeping:
            return
        if self.owner:
            self._c.extra.update(self._call(Command.WAKE, None if tags is None else list(tags)))
        if tags is None or "kv_cache" in tags:
            self.sleeping = False

    def stats(self) -> dict:
        out = super().stats()
        if self.owner and self._conn is not None:
            out["server"] = self._call(Command.STATS)
        return out

    def begin_close(self) -> None:
        """Tell the server to shut down without waiting for it (`close` waits): several servers then stop at once."""
        conn, self._conn = self._conn, None
        self._unread.clear()  # replies nobody will read now
        if conn is not None:
            try:
                conn.send((Command.CLOSE,))
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.weights is not None:
            self.weights.detach()
        self.begin_close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self.weights is not None:
            self.weights.close()  # our weight group once the server's end is gone
        for attr in ("_listener", "_log"):
            obj = getattr(self, attr)
            if obj is not None:
                obj.close()
                setattr(self, attr, None)

