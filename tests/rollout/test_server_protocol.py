"""The rollout server's protocol (`server/protocol.py`) and its session (`server/server.py:ServerSession`), without
vLLM: every command has its handler taking the arguments the protocol names, and the session keeps a sync's loading
time across the commands of that sync."""

from __future__ import annotations

import inspect
import types

import pytest

from ds_rlhf.rollout.server import server
from ds_rlhf.rollout.server.protocol import MESSAGES, Command
from ds_rlhf.rollout.server.server import ServerSession


def test_every_command_has_one_message_shape_and_the_session_answers_it_with_those_arguments():
    assert set(MESSAGES) == set(Command)
    session = ServerSession()
    assert set(session.handlers) == set(Command) - {Command.CLOSE}  # 'close' ends the loop, answered by no one
    for cmd, handler in session.handlers.items():
        assert tuple(inspect.signature(handler).parameters) == MESSAGES[cmd].args, cmd


def test_commands_before_start_and_unknown_commands_are_refused():
    session = ServerSession()
    with pytest.raises(RuntimeError, match="'stats' before 'start'"):
        session.handle("stats", ())
    session.engine = object()
    with pytest.raises(ValueError, match="unknown command 'nope'"):
        session.handle("nope", ())


class _Handle:
    """vLLM's weight-transfer calls on a clock of its own: each chunk's load takes one second."""

    def __init__(self, seen: list):
        self.seen, self.now = seen, 0.0

    def transfer_update(self, info):
        self.now += 1.0
        self.seen.append(("update", info))

    def transfer_finish(self):
        self.seen.append(("finish",))

    def reset_prefix_cache(self):
        self.seen.append(("reset",))


class _Engine:
    def __init__(self):
        self.seen, self.updates = [], []
        self.handle = _Handle(self.seen)
        self.weights = types.SimpleNamespace(record=lambda nbytes, seconds: self.updates.append((nbytes, seconds)))



def test_a_syncs_loading_time_sums_its_chunks_and_starts_again_after_the_finish(monkeypatch):
    session, engine = ServerSession(), _Engine()
    session.engine = engine
    monkeypatch.setattr(server, "time", types.SimpleNamespace(perf_counter=lambda: engine.handle.now))
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4, 2]]}
    assert session.handle(Command.WT_UPDATE, (info,)) is None
    assert session.handle("wt_update", (info,)) is None  # the plain string is the same command
    assert session.handle(Command.WT_FINISH, ()) == {"load_seconds": 2.0}
    assert engine.seen[-2:] == [("finish",), ("reset",)] and engine.updates == [(32, 1.0), (32, 1.0)]
    assert session.handle(Command.WT_FINISH, ()) == {"load_seconds": 0.0}  # the next sync counts from zero
