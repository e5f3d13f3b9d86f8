"""The rollout server's protocol, defined once: its commands and the shape of each message, for the client
(`client.py`), the calls to several servers (`calls.py`, `sharded.py`) and the server (`server.py`).

A message is a pickled tuple `(command, *args)` sent over the authenticated local socket; the server answers every
command but `close` in the order it came with `(OK, payload)` or `(ERROR, the server's traceback)`. Weights do not
travel in messages: `update` announces the buckets that follow over the weight group, `update_ipc` the bucket the
trainer wrote into the shared CUDA buffer that `init_ipc` mapped, the `wt_*` commands forward vLLM's
weight-transfer calls (init / start / update / finish) with their info dicts, and `shared_update` says the trainer
wrote a sync into the buffer the server's parameters are views of (`rollout.weight_transport shared`: 'start'
mapped it, from `engine_kwargs["shared_weights"]`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

OK, ERROR = "ok", "error"  # the first item of every reply


class Command(enum.StrEnum):
    """The commands the server answers (a member equals its string, the value that goes over the socket)."""

    START = "start"
    GENERATE_MANY = "generate_many"
    LOGPROBS = "logprobs"
    INIT_GROUP = "init_group"
    UPDATE = "update"
    INIT_IPC = "init_ipc"
    UPDATE_IPC = "update_ipc"
    UPDATE_DONE = "update_done"
    WT_INIT = "wt_init"
    WT_START = "wt_start"
    WT_UPDATE = "wt_update"
    WT_FINISH = "wt_finish"
    SHARED_UPDATE = "shared_update"
    SLEEP = "sleep"
    WAKE = "wake"
    STATS = "stats"
    CLOSE = "close"


@dataclass(frozen=True)
class Shape:
    """One command's message: the arguments after the command, in order, and what its `OK` reply carries."""

    args: tuple[str, ...]
    reply: str


MESSAGES: dict[Command, Shape] = {
    Command.START: Shape(("model_path", "engine_kwargs"),
                         "{dtype, world, version, start_seconds, options[, shared_layout]}: the engine is built "
                         "(shared_layout: [(HF name, element offset, shape)] in the trainer's buffer, with "
                         "engine_kwargs['shared_weights'], the function and arguments that map it)"),
    Command.GENERATE_MANY: Shape(("groups",), "{rows, seconds, tokens}: per (prompts, spec) group, its samples' "
                                              "fields as tuples"),
    Command.LOGPROBS: Shape(("sequences",), "the per-token log-probs of each sequence"),
    Command.INIT_GROUP: Shape(("host", "port", "world_size", "backend", "timeout_s"),
                              "None: the vLLM workers joined our weight group"),
    Command.UPDATE: Shape(("wire_plan",), "{load_seconds}: every announced bucket received and loaded"),
    Command.INIT_IPC: Shape(("rebuild",), "None: the trainer's shared buffer is mapped (`reduce_tensor` of a CUDA "
                                          "buffer, or a function and its arguments that map another)"),
    Command.UPDATE_IPC: Shape(("wire_plan",), "None: the one bucket in the shared buffer is loaded"),
    Command.UPDATE_DONE: Shape((), "{load_seconds}: this sync's loading time over IPC"),
    Command.WT_INIT: Shape(("init_info",), "None: vLLM's `init_weight_transfer_engine` returned"),
    Command.WT_START: Shape((), "None: vLLM's `start_weight_update` returned"),
    Command.WT_UPDATE: Shape(("update_info",), "None: vLLM's `update_weights` loaded the chunk (or broadcasts)"),
    Command.WT_FINISH: Shape((), "{load_seconds}: vLLM's `finish_weight_update` returned, this sync's loading time"),
    Command.SHARED_UPDATE: Shape(("nbytes",), "{load_seconds}: the prefix cache is reset after the trainer wrote "
                                              "`nbytes` into the shared weight buffer"),
    Command.SLEEP: Shape((), "the engine's sleep_* stats"),
    Command.WAKE: Shape(("tags",), "the engine's wake_* stats"),
    Command.STATS: Shape((), "the engine's stats"),
    Command.CLOSE: Shape((), "no reply: the server shuts down"),
}
