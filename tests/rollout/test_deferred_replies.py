"""A server's replies are read in the order its commands were sent (`RemoteVLLMEngine.send_command` -> `Pending`):
reading one reply keeps the earlier ones for their own readers, a failed one raises only where it is read, and a
sync made without waiting (`update_weight_buckets_later`) is acknowledged behind the generation queued after it.
Over a real pipe with a scripted server, no vLLM."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from ds_rlhf.rollout.base import Pending, RolloutEngine, RolloutError
from ds_rlhf.rollout.remote import RemoteVLLMEngine
from ds_rlhf.rollout.server_calls import all_of, command_all


class _Alive:
    returncode = None

    def poll(self):
        return None


def _engine_with_script(answers: dict):
    """A RemoteVLLMEngine talking to a thread that answers each command from `answers` (cmd -> reply, or an
    Exception to send back as a server failure), in order. Returns (engine, commands seen)."""
    ours, theirs = Pipe()
    seen = []

    def serve():
        while True:
            try:
                msg = theirs.recv()
            except (EOFError, OSError):  # the test's end dropped our pipe
                return
            seen.append(msg[0])
            reply = answers[msg[0]]
            theirs.send(("error", f"Traceback: {reply}") if isinstance(reply, Exception) else ("ok", reply))

    threading.Thread(target=serve, daemon=True).start()
    engine = object.__new__(RemoteVLLMEngine)
    RolloutEngine.__init__(engine)
    engine.timeout_s, engine._conn, engine._proc, engine._d = 10.0, ours, _Alive(), None
    from collections import deque

    engine._unread, engine._in_flight, engine._generation = deque(), False, None
    return engine, seen


def test_replies_are_read_in_order_and_kept_for_their_readers():
    engine, seen = _engine_with_script({"update_done": None, "score": [[-1.0]], "stats": {"n": 1}})
    done = engine.send_command("update_done")
    scores = engine.send_command("score", [[1, 2]])
    # a later call reads through the two replies before its own and keeps them for their Pending
    assert engine._call("stats") == {"n": 1}
    assert not engine._unread and seen == ["update_done", "score", "stats"]
    assert scores.result() == [[-1.0]] and done.result() is None
    assert scores.result() == [[-1.0]]  # the same value on every call


def test_a_failed_reply_raises_where_it_is_read_and_the_stream_stays_in_step():
    engine, _ = _engine_with_script({"update_ipc": ValueError("no parameter named x"), "score": [[-2.0]]})
    failed = engine.send_command("update_ipc")
    scores = engine.send_command("score", [[1, 2]])
    assert scores.result() == [[-2.0]]  # read past the failure: it is kept for its own reader
    with pytest.raises(RolloutError, match="no parameter named x"):
        failed.result()
    with pytest.raises(RolloutError, match="no parameter named x"):
        failed.result()  # and stays raised
    assert engine._call("score", [[3]]) == [[-2.0]]


def test_all_of_reads_every_reply_before_raising_the_first_failure():
    a, _ = _engine_with_script({"score": RuntimeError("server a broke")})
    b, _ = _engine_with_script({"score": [[0.5]]})
    with pytest.raises(RolloutError, match="server a broke"):
        command_all([a, b], "score", [[1]])
    assert not a._unread and not b._unread  # b's reply was read too
    ok = all_of([Pending.done(1), Pending.done(2)])
    assert ok.result() == [1, 2]


def test_a_reply_read_twice_or_never_sent_is_an_error():
    engine, _ = _engine_with_script({"stats": {}})
    stray = Pending(lambda: engine._read_until(object()))
    with pytest.raises(RolloutError, match="no reply is pending"):
        stray.result()
