"""Calls to several rollout servers at once (`rollout.sidecar_engines`, `sharded.py`, the transports of
`transports.py`) over their clients: send to all, then read every reply even after one failed, so no connection is
left with a reply that a later call would take for its own; vLLM's weight-transfer client calls over our servers
(`ServersWeightClient`); the servers' acknowledgements of one update as one (`slowest_load`)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Sequence
from typing import Protocol

from ds_rlhf.rollout.base import Pending, RolloutError
from ds_rlhf.rollout.server.protocol import Command


class RolloutServer(Protocol):
    """What these calls and the transports use of a rollout server's client (`client.RemoteVLLMEngine`)."""

    host: str
    world: int  # the server's vLLM workers (its tensor-parallel size)
    timeout_s: float
    bucket_bytes: int
    owner: bool  # this rank talks to the server (rank 0)

    @property
    def process(self) -> subprocess.Popen | None: ...

    @property
    def defers_replies(self) -> bool: ...

    def send_command(self, *msg) -> Pending: ...

    def wait_replies(self) -> None: ...


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


def slowest_load(replies: list) -> dict:
    """The servers' acknowledgements of one weight update as one: the slowest server's `load_seconds`."""
    seconds = [r["load_seconds"] for r in replies if isinstance(r, dict) and r.get("load_seconds") is not None]
    return {"load_seconds": max(seconds)} if seconds else {}
