"""A training run's lifecycle, the same for the RL loop and the supervised one (SFT, RM, DPO): the signal handlers
around the whole run, the stop points a loop asks after a step and after a save or an export, the shut-down
(the loop's own resources closed, `status.json` written, the run directory's lock released) and the exit code.

A SIGTERM / SIGINT (`signals.GracefulStop`) lets the current step finish, saves it and exits 128 + the signal; one
that comes during a periodic save or export stops the run right after it; one after the last step waits for the
final checkpoint and export, then exits the same way. `status.json` then says `stopped` (`monitor.exit_status`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ds_rlhf.run.context import RunContext
from ds_rlhf.run.monitor import RunMonitor
from ds_rlhf.run.signals import GracefulStop

T = TypeVar("T")


class RunLifecycle:
    """One run's signals, stop points, shut-down and exit.

    `save()` writes the checkpoint of the step just finished; `step()` is the loop's step count (for
    `status.json`). `on_signal` / `on_exit` go to `GracefulStop`. `cut_short`: exceptions that mean the signal cut
    the step itself (a reward server's request stopped mid-step): the run exits 128 + the signal without saving
    that step. Each must carry the `signum` it was stopped by.
    """

    def __init__(self, ctx: RunContext, name: str, total_steps: int, *, save: Callable[[], object],
                 step: Callable[[], int], on_signal: Sequence[Callable[[int], object]] = (),
                 on_exit: Sequence[Callable[[], object]] = (), cut_short: tuple[type[BaseException], ...] = ()):
        self.ctx, self.name = ctx, name
        self.monitor = RunMonitor.for_run(ctx, name, total_steps)  # status.json says how a run ended
        self.save, self.step = save, step
        self.on_signal, self.on_exit, self.cut_short = tuple(on_signal), tuple(on_exit), cut_short
        self.stop: GracefulStop | None = None

    def build(self, build: Callable[[], T]) -> T:
        """Run the loop's `build`; a failure there is written to `status.json` (at step 0) and raised."""
        try:
            return build()
        except BaseException as exc:
            self.monitor.finish(exc, step=0)
            raise

    def run(self, body: Callable[[], T], close: Callable[[], object] = lambda: None) -> T:
        """Run the loop's `body` under the signal handlers, then shut down: `close()` (the loop's loggers, engines,
        servers), `status.json`, the run directory's lock. A signal that came during the final save or export, or
        during the shut-down, exits 128 + the signal once they are done."""
        ctx = self.ctx
        error: BaseException | None = None
        with GracefulStop(ctx.dist.device, announce=ctx.print, on_signal=self.on_signal,
                          on_exit=self.on_exit) as stop:
            self.stop = stop
            try:
                result = body()
                if stop.signum:  # it came during the final save or export, which are done: status.json says stopped
                    stop.exit(stop.signum, announce=ctx.print)
            except self.cut_short as exc:  # the signal cut this step: it cannot finish
                error = SystemExit(128 + (stop.signum or exc.signum))
                ctx.print(f"[signal] a reward request was stopped mid-step; exiting with {error.code}, this step "
                          "unsaved (the last checkpoint stands)")
                raise error from None
            except BaseException as exc:
                error = exc
                raise
            finally:
                try:
                    close()
                finally:
                    self.monitor.finish(error, step=self.step())  # status.json, before the lock is released
                    ctx.close()  # releases the run directory's lock
            if stop.signum:  # it came during the shut-down, after the final checkpoint was saved
                stop.exit(stop.signum, announce=ctx.print)
        return result

    def after_step(self) -> None:
        """After a finished step: on a signal (any rank's), save this step and exit 128 + the signal."""
        if signum := self._pending():
            self.save()
            GracefulStop.exit(signum, announce=self.ctx.print)

    def after_save(self, saved: bool) -> None:
        """After a periodic save or export (`saved`: this step's checkpoint was written): a signal that came during
        it stops the run now, not a step later, with this step saved."""
        if signum := self._pending():
            if not saved:
                self.save()
            GracefulStop.exit(signum, announce=self.ctx.print)

    def _pending(self) -> int:
        if self.stop is None:
            raise RuntimeError("RunLifecycle: the stop points are asked inside run()")
        return self.stop.pending()
