"""A server's replies are read in the order its commands were sent (`RemoteVLLMEngine.send_command` -> `Pending`):
reading one reply keeps the earlier ones for their own readers, a failed one raises only where it is read, a lost
connection fails every reply still owed, and only a one-rank engine defers. Over a real pipe with a scripted
server thread, no vLLM."""

from __future__ import annotations

import threading
from collections import deque
from multiprocessing import Pipe

import pytest
import torch

from ds_rlhf.rollout.base import Pending, RolloutEngine, RolloutError
from ds_rlhf.rollout.server.calls import all_of, command_all
from ds_rlhf.rollout.server.client import ConnectionLost, RemoteVLLMEngine
from ds_rlhf.rollout.server.transports import OwnIPC


class _Alive:
    returncode = None

    def poll(self):
        return None


def _engine_with_script(answers: dict, hang_up_after: int | None = None, hang_up_when=None):
    """A RemoteVLLMEngine talking to a thread that answers each command with (its position, `answers[cmd]`), or
    sends `answers[cmd]` back as a server failure when it is an Exception; it closes the connection instead of
    answering command number `hang_up_after` (once the event `hang_up_when` is set, when given). Returns (engine,
    commands seen)."""
    ours, theirs = Pipe()
    seen = []

    def serve():
        while True:
            try:
                msg = theirs.recv()
            except (EOFError, OSError):  # the test's end dropped our pipe
                return
            if len(seen) == hang_up_after:
                if hang_up_when is not None:
                    hang_up_when.wait(10)
                theirs.close()
                return
            seen.append(msg[0])
            reply = answers[msg[0]]
            if isinstance(reply, Exception):
                theirs.send(("error", f"Traceback: {reply}"))
            else:
                theirs.send(("ok", (len(seen) - 1, reply)))

    threading.Thread(target=serve, daemon=True).start()
    engine = object.__new__(RemoteVLLMEngine)
    RolloutEngine.__init__(engine)
    engine.timeout_s, engine._conn, engine._proc, engine._d = 10.0, ours, _Alive(), None
    engine._unread, engine._in_flight, engine._generation, engine._lost = deque(), False, None, None
    return engine, seen


def test_replies_are_read_in_order_and_kept_for_their_readers():
    engine, seen = _engine_with_script({"update_done": None, "logprobs": [[-1.0]], "stats": {"n": 1}})
    done = engine.send_command("update_done")
    scores = engine.send_command("logprobs", [[1, 2]])
    # a later call reads through the two replies before its own and keeps them for their Pending
    assert engine._call("stats") == (2, {"n": 1})
    assert not engine._unread and seen == ["update_done", "logprobs", "stats"]
    assert scores.result() == (1, [[-1.0]]) and done.result() == (0, None)
    assert scores.result() == (1, [[-1.0]])  # the same value on every call


def test_a_failed_reply_raises_where_it_is_read_and_the_stream_stays_in_step():
    engine, _ = _engine_with_script({"update_ipc": ValueError("no parameter named x"), "logprobs": [[-2.0]]})
    failed = engine.send_command("update_ipc")
    scores = engine.send_command("logprobs", [[1, 2]])
    assert scores.result() == (1, [[-2.0]])  # read past the failure: it is kept for its own reader
    with pytest.raises(RolloutError, match="no parameter named x"):
        failed.result()
    with pytest.raises(RolloutError, match="no parameter named x"):
        failed.result()  # and stays raised
    assert engine._call("logprobs", [[3]]) == (2, [[-2.0]])  # the next command gets its own reply


def test_a_lost_connection_fails_every_reply_still_owed_and_every_later_command():
    sent = threading.Event()
    engine, _ = _engine_with_script({"update_ipc": None, "logprobs": [[0.0]]}, hang_up_after=1, hang_up_when=sent)
    first = engine.send_command("update_ipc")
    lost = [engine.send_command("logprobs", [[1]]) for _ in range(2)]
    sent.set()  # every command is on its way: now the server hangs up instead of answering the first score
    assert first.result() == (0, None)
    with pytest.raises(ConnectionLost, match="connection lost"):
        lost[0].result()
    with pytest.raises(ConnectionLost):
        lost[1].result()  # never taken for an answer that could still arrive
    with pytest.raises(ConnectionLost):
        engine.send_command("stats")


def test_a_later_reply_read_first_fails_with_the_lost_connection_not_as_unowed():
    """A generation's reply read while the connection dies under an earlier owed reply (a weight update handed over
    without waiting): both fail with the connection's error."""
    sent = threading.Event()
    engine, _ = _engine_with_script({"update_ipc": None, "generate_many": []}, hang_up_after=0, hang_up_when=sent)
    update = engine.send_command("update_ipc")
    generation = engine.send_command("generate_many")
    sent.set()
    with pytest.raises(ConnectionLost, match="connection lost"):
        generation.result()
    with pytest.raises(ConnectionLost):
        update.result()


def test_all_of_reads_every_reply_before_raising_the_first_failure():
    a, _ = _engine_with_script({"logprobs": RuntimeError("server a broke")})
    b, _ = _engine_with_script({"logprobs": [[0.5]]})
    with pytest.raises(RolloutError, match="server a broke"):
        command_all([a, b], "logprobs", [[1]])
    assert not a._unread and not b._unread  # b's reply was read too
    assert all_of([Pending.done(1), Pending.done(2)]).result() == [1, 2]


def test_a_reply_no_command_owes_is_an_error():
    engine, _ = _engine_with_script({"stats": {}})
    stray = Pending(lambda: engine._read_until(object()))
    with pytest.raises(RolloutError, match="no reply is pending"):
        stray.result()


def test_only_a_one_rank_engine_defers_and_an_awake_one_is_not_woken():
    engine, seen = _engine_with_script({"logprobs": [[-1.0]], "wake": {}})
    assert engine.defers_replies
    owed = engine.logprobs_replicas_later([[1, 2]])
    engine.wake()  # awake already: no call, so the owed reply is not read here
    assert len(engine._unread) == 1
    assert owed.result() == [(0, [[-1.0]])] and seen == ["logprobs"]
    engine._d = object()  # several ranks: a failure must reach every rank at once, nothing is deferred
    assert not engine.defers_replies


def test_an_owed_weight_update_is_read_once_by_the_next_update():
    """A transport keeps the replies of an update handed over without waiting (`owed`); `settle` (the next update
    over the shared buffer) reads them before the buffer is written again, and only once."""
    engine, seen = _engine_with_script({"update_done": {"load_seconds": 0.1}})
    transport = OwnIPC(engine, torch.float32)
    transport.settle()  # nothing owed: nothing read or sent
    transport.owed = engine.send_command("update_done")
    assert len(engine._unread) == 1
    transport.settle()
    assert not engine._unread and seen == ["update_done"]
    transport.settle()  # read already: nothing more
    assert transport.owed is None
