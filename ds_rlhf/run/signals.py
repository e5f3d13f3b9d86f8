"""SIGTERM / SIGINT during training: finish the current step, save a checkpoint, exit with 128 + the signal.

A scheduler's SIGTERM (preemption, `scancel`, `kill`) or a Ctrl-C then loses no finished step: the run's lifecycle
(`lifecycle.RunLifecycle`, the same for every loop) asks `stop.pending()` after every step, and again right after a
periodic checkpoint save (or export) so a signal that came during it stops the run there instead of a step later;
all ranks agree (one tiny collective), so they save the same step together.
A second signal exits at once (`os._exit(128 + signal)`), for when the current step itself is what hangs.
`on_signal` callbacks run at the first signal (inside the handler, so they must not block or take locks): the RL
recipe passes the remote reward's `interrupt`, which leaves requests to a reward server a few seconds and then
ends them, so a step waiting on a hung server stops instead of waiting out its deadline and retries; its
`on_exit`, the remote reward's `clear_interrupt`, forgets that stop when the run ends, so a process that goes on (a
notebook's next run, a test worker) starts without it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from ds_rlhf.distributed import agree_max

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing)."""

    def __init__(self, device="cpu", announce=print, on_signal: Sequence[Callable[[int], object]] = (),
                 on_exit: Sequence[Callable[[], object]] = ()):
        self.device, self.announce, self.on_signal, self.on_exit = device, announce, tuple(on_signal), tuple(on_exit)
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:  # the second signal: no more waiting
            os._exit(128 + signum)
        self.signum = signum
        self.announce(f"[signal] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                      "(send it again to exit at once)")
        for callback in self.on_signal:
            callback(signum)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        for callback in self.on_exit:  # what on_signal set is the stopped run's, not the process's
            callback()

    def pending(self) -> int:
        """The signal number any rank received (0 = none); the same answer on every rank."""
        return agree_max(self.signum, self.device)

    @staticmethod
    def exit(signum: int, announce=print) -> None:
        announce(f"[signal] checkpoint saved; exiting with {128 + signum}")
        sys.stdout.flush()
        raise SystemExit(128 + signum)
