"""A pool of reward worker processes with a per-call timeout; a hung or dead worker is killed and replaced.

Workers are started with `spawn` (or `forkserver`) because the trainer holds torch/DeepSpeed/NCCL threads and
forking it is unsafe. Each worker loads every reward function itself, by built-in name or file path, once, and
then serves calls over its own pipe; the pool lives across steps, so the start cost is paid once (and again only
for a worker replaced after a timeout, in the background). SIGINT is ignored in workers: Ctrl-C stops the trainer,
which then ends the pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait

from ds_rlhf.rewards.calling import Outcome, detect_style, invoke, make_call
from ds_rlhf.rewards.loading import load_reward_fn

START_TIMEOUT_S = 300.0  # default: a worker that cannot import its reward functions in this long is an error
NOTE_AFTER_S = 5.0  # a worker still importing after this long: one progress line says what it waits for


def _worker_main(conn, members) -> None:
    """members: [(source, style or None)], source a spec string (loaded here, by path) or a picklable callable."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fns = [load_reward_fn(src) if isinstance(src, str) else src for src, _ in members]
        styles = [style or detect_style(fn) for fn, (_, style) in zip(fns, members)]
        calls = [make_call(fn, style) for fn, style in zip(fns, styles)]
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", styles))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, member, items = msg
        conn.send((call_id, invoke(calls[member], items, in_worker=True)))


class _Worker:
    def __init__(self, ctx, members):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, members), daemon=True, name="ds_rlhf-reward")
        try:
            self.proc.start()
        except Exception as exc:  # typically a plain function that cannot be pickled for the worker
            raise ValueError(f"cannot start a reward worker ({type(exc).__name__}: {exc}); give user functions "
                             "as path/to/file.py:function_name") from exc
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (call id, deadline)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        with contextlib.suppress(OSError):
            w.conn.send(None)
    for w in workers:
        w.proc.join(2)
        w.kill()


class RewardPool:
    """Runs `(member index, items)` calls on `workers` processes; a call past `timeout` s is a bad reward.

    The user code runs only in the workers: the trainer never imports the user's reward file.
    """

    def __init__(self, members: list[tuple[object, str | None]], workers: int, timeout: float,
                 mp_context: str = "spawn", start_timeout: float = START_TIMEOUT_S,
                 announce: Callable[[str], object] | None = print, note_after: float = NOTE_AFTER_S):
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"reward mp_context must be spawn or forkserver (fork is unsafe here), got {mp_context}")
        if workers < 1 or not timeout > 0:
            raise ValueError(f"a reward pool needs workers >= 1 and timeout > 0, got {workers}, {timeout}")
        self.members, self.timeout = members, float(timeout)
        # the import of the reward modules: at most `start_timeout` s, one progress line after `note_after` s
        self.start_timeout, self.announce, self.note_after = float(start_timeout), announce, note_after
        self._noted = False
        self._ctx = mp.get_context(mp_context)
        self._workers = [_Worker(self._ctx, members) for _ in range(workers)]
        self.replaced = 0  # workers killed (hung) or lost (died) and started again
        self.styles: list[str] | None = None  # each member's calling convention, as the first worker detected it
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def close(self) -> None:
        self._finalizer()

    def wait_ready(self) -> list[str]:
        """Block until every worker has loaded the functions (raises if one cannot); their detected styles."""
        self._guarded(self._loop, [], [], deque(), until_ready=True)
        return self.styles

    def run(self, calls: list[tuple[int, list[dict]]]) -> list[list[Outcome]]:
        """Outcomes per call, in order. A call in flight longer than `timeout` is cut off and its worker replaced."""
        results: list[list[Outcome] | None] = [None] * len(calls)
        self._guarded(self._loop, calls, results, deque(range(len(calls))))
        return results

    def _guarded(self, loop, *args, **kwargs):
        if not self._finalizer.alive:
            raise RuntimeError("the reward pool is closed")
        try:
            return loop(*args, **kwargs)
        except BaseException:  # a load error, a lost worker at start, Ctrl-C: the pool state is unknown
            self.close()
            raise

    def _loop(self, calls, results, pending: deque, until_ready: bool = False) -> None:
        while pending or any(w.task for w in self._workers) or (until_ready and not all(
                w.ready for w in self._workers)):
            self._dispatch(calls, pending)
            now = time.monotonic()
            loading = [w for w in self._workers if not w.ready]
            deadlines = [w.task[1] for w in self._workers if w.task] + [
                w.started + self.start_timeout for w in loading]
            if loading and not self._noted and self.announce is not None:
                deadlines.append(min(w.started for w in loading) + self.note_after)
            ready = wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines, default=now) - now))
            for w in list(self._workers):
                if w.conn in ready:
                    self._receive(w, calls, results)
            self._expire(calls, results)

    def _dispatch(self, calls, pending: deque) -> None:
        for w in self._workers:
            if pending and w.ready and w.task is None:
                call_id = pending.popleft()
                try:
                    w.conn.send((call_id, *calls[call_id]))
                except OSError:  # died while idle: not the call's fault, run it elsewhere
                    pending.appendleft(call_id)
                    self._replace(w)
                    continue
                w.task = (call_id, time.monotonic() + self.timeout)

    def _receive(self, w: _Worker, calls, results) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(1)
            if w.task is not None:
                call_id = w.task[0]
                results[call_id] = [f"reward worker died (exit code {w.proc.exitcode})"] * len(calls[call_id][1])
            elif not w.ready:
                raise RuntimeError(f"a reward worker died while loading (exit code {w.proc.exitcode})") from None
            self._replace(w)
            return
        if msg[0] == "ready":
            w.ready = True
            self.styles = self.styles or msg[1]
        elif msg[0] == "error":
            raise RuntimeError(f"a reward worker could not load the reward functions: {msg[1]}")
        else:
            results[msg[0]], w.task = msg[1], None

    def _expire(self, calls, results) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now >= w.task[1]:
                call_id = w.task[0]
                results[call_id] = [f"timed out after {self.timeout:g}s"] * len(calls[call_id][1])
                self._replace(w)
            elif not w.ready and now >= w.started + self.start_timeout:
                raise RuntimeError(f"reward module(s) {self._modules()} did not finish importing in "
                                   f"{self.start_timeout:g}s (reward.import_timeout): make the import faster "
                                   "(no downloads or heavy set-up at module level) or raise that setting")
            elif not w.ready and not self._noted and self.announce is not None \
                    and now >= w.started + self.note_after:
                self._noted = True
                self.announce(f"[reward] importing reward module(s) {self._modules()} ... (waiting up to "
                              f"{self.start_timeout:g}s, reward.import_timeout)")

    def _modules(self) -> str:
        """The user files the workers import (the specs' `path.py` parts), or the built-in names."""
        names = [src.rsplit(":", 1)[0] if isinstance(src, str) else getattr(src, "__name__", type(src).__name__)
                 for src, _ in self.members]
        return ", ".join(dict.fromkeys(names))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.members)
        self.replaced += 1
