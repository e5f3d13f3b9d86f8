"""The one owner of the rollout engine during a run: when it generates, when it gets new weights, when it sleeps.

`RolloutService` holds the engine, the weight sync (`sync.py:WeightSync`, with its canary), the batch in flight and
the version of the weights the engine holds (trainer updates applied to them; 0 = the initial weights). A recipe
talks to it through a few calls:

    service.start(version)         the first sync, before any rollout (a sleeping colocated engine is put to sleep
                                   first, so the sync wakes its weights only)
    service.batch(step)            stage 1: the batch step `step` (0-based: the trainer's weights after `step`
                                   updates) trains on; never one whose weights' hand-over and canary are unconfirmed
    service.publish(version)       stage 5: the trainer's weights after `version` updates exist
    service.quiesce(version=None)  before an evaluation or a checkpoint: nothing in flight against the engine, every
                                   sync confirmed, the batches the engine's weights still owe generated (async);
                                   with `version`, the engine also holds those weights after it
    service.take_report()          the syncs and confirmations since the last call, as one dict (or None)
    service.state_dict() / load_state_dict(state)   pure: the batches kept (call `quiesce()` first)

It is handed what lies above the rollout layer: `prompts()` draws the next prompt rows (the recipe's loader),
`spec(step)` is the step's `SamplingSpec`, `release_memory()` frees the trainer's cached device memory before a
sleeping colocated engine wakes its weights for a sync.

Synchronous (default, exact on-policy): `batch(step)` generates with the weights after `step` updates; `publish`
syncs at once. With `overlap_sync` that sync does not wait for an engine that can defer (a server on one rank:
`WeightSync.sync(wait=False)`) while another step follows: the engine runs its commands in order, so it loads the
weights and scores the canary's probe before it generates the next batch, and the service confirms both
(`WeightSync.confirm`) when that batch is collected, before it is returned. The last step's sync waits.

Asynchronous (`asynchronous=True`): `batch(step)` collects the batch in flight (submitted by the previous call),
then submits step+1's, which the engine generates while the trainer trains on step `step`'s. Every sample carries
the weights version it was generated with (`RolloutSample.weights_version`; the batch's `weights_version` is its
oldest). The engine gets new weights only while it is idle (between that collect and the next submit), and only
when the next batch would otherwise be more than `max_staleness` (k) updates old: the weights of the schedule's
last sync (`schedule_version`) serve k batches, so with k = 1 every step syncs and its next batch is one update old,
with k > 1 one step in k syncs and its batches are 1, 2, ..., k updates old. `publish` itself moves nothing. With
`overlap_sync` that sync hands over without waiting, the next batch queues behind the load, and the collect of that
batch confirms the load and the canary before the batch is returned. The canary's figures go into the report of the
step that trains on the batch (`canary_*`, `confirm_seconds`), the hand-over's into the report of the step that
made it (`seconds`, `bytes`, ...).

Every confirmation happens in one place, `_confirm` (a collect, `quiesce`, a sync), and only when a sync awaits
one (`WeightSync.pending`), so each deferred sync is confirmed exactly once.

Checkpoints and evaluations: `quiesce()` collects the batch in flight and keeps it as a finished batch; in async
mode it also generates, one after the other, the later batches the schedule would generate with the weights the
engine holds (k > 1: up to the step whose batch needs the next sync) and keeps them in `queue`. `state_dict()`
then saves every kept batch (rows, samples, each sample's weights version) and `schedule_version`, so a resumed run,
whose engine holds the checkpoint's newer weights, trains on exactly the batches the uninterrupted one does: the
batches that need the older weights are in the checkpoint, and the next batch after them comes from a sync to the
trainer's weights in both runs. An evaluation (`quiesce(version)`) syncs the engine to its step's weights after
that, so the batches it trains on after the evaluation are those of a run without it. The cost: a save or an
evaluation waits for up to k - 1 batches' generation (none at a step where the schedule syncs next, e.g. every
multiple of k from step 0). The one difference a queued batch makes: its prompts are drawn when it is generated,
earlier than in a run without the save or evaluation (with `rl.curriculum`, whose draws depend on the steps
observed before them, the prompts may then differ).

A new rollout mode (multi-turn episodes, an agent loop): subclass and override `generate(rows, spec)`, the one
method that turns prompt rows into samples. It returns a `Pending` whose `result()` is `(samples, generation)`
(`generation`: the engine's `(seconds, response tokens)` or None), or a `Generated` when the batch's rows are not
the rows it was given (`partial.py` trains on the groups that finished, carried over from earlier calls). Do the
work in `generate` itself and return `Pending.done(...)`, or in the `Pending`'s read, which the service calls when
it collects the batch (in async mode after the trainer's step; the engine holds the same weights then: syncs happen
only after a collect). The service keeps owning when it runs (after a wake, with the weights of `engine_version`),
the syncs and their confirmations, sleep, the batch in flight and its checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ds_rlhf.rollout.base import Pending, RolloutBatch, RolloutEngine, RolloutSample, SamplingSpec
from ds_rlhf.rollout.weights.sync import WeightSync
from ds_rlhf.telemetry import PhaseTimer

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    rows: list[dict]
    result: Pending  # (samples, the engine's (seconds, tokens) or None: restored from a checkpoint)
    weights_version: int
    step: int | None = None  # the step that trains on it (None: restored from a checkpoint that did not say)


def _plain(value):
    """Store rows hold numpy arrays; checkpoints hold plain lists (loadable with weights_only=True)."""
    return value.tolist() if hasattr(value, "tolist") else value


def plain_row(row: dict) -> dict:
    """A prompt row as a checkpoint holds it (`_plain` values)."""
    return {k: _plain(v) for k, v in row.items()}


@dataclass
class Generated:
    """What a rollout mode's `generate` may return instead of `(samples, generation)`: the batch's own `rows`
    (which then replace the rows it was given) and the `weights_version` it counts as (its oldest weights), for a
    mode whose batches are not exactly the rows of one call (`partial.py`: groups finished across calls)."""

    samples: list[RolloutSample]
    generation: tuple[float, int] | None
    rows: list[dict]
    weights_version: int


def _batch_of(job: _InFlight) -> RolloutBatch:
    """The finished job as a batch: its samples with the rows and weights version it was submitted with, or those a
    `Generated` result names. A sample without its own `weights_version` gets the job's; the batch's
    `weights_version` is its oldest sample's."""
    out = job.result.result()
    if isinstance(out, Generated):
        rows, samples, version, generation = out.rows, out.samples, out.weights_version, out.generation
    else:
        (samples, generation), rows, version = out, job.rows, job.weights_version
    samples = [s if s.weights_version is not None else dataclasses.replace(s, weights_version=version)
               for s in samples]
    oldest = min((s.weights_version for s in samples), default=version)
    return RolloutBatch(rows=rows, samples=samples, weights_version=oldest, generation=generation)


def merge_reports(*reports: dict | None) -> dict | None:
    """Sync reports of one step as one (a handover and the confirmation of an earlier sync): later values win, but
    None never hides a value (a handover's canary figure, not known yet, leaves the confirmed one). None if empty."""
    out: dict = {}
    for report in reports:
        for key, value in (report or {}).items():
            if value is not None or key not in out:
                out[key] = value
    return out or None


class RolloutService:
    """See the module docstring. `prompts`: draws the next prompt rows; `spec`: the `SamplingSpec` of a step;
    `total_steps`: the run's steps (the last step's sync waits, no batch is submitted past the last step);
    `release_memory`: called before every sync when the engine `sleeps` (a colocated engine that sleeps between
    phases); `version`: the weights version the engine holds before `start`."""

    def __init__(self, engine: RolloutEngine, sync: WeightSync, *, prompts: Callable[[], list[dict]],
                 spec: Callable[[int], SamplingSpec], total_steps: int, timer: PhaseTimer | None = None,
                 release_memory: Callable[[], None] | None = None, asynchronous: bool = False,
                 max_staleness: int = 1, overlap_sync: bool = True, sleeps: bool = False, version: int = 0):
        self.engine, self.sync = engine, sync
        self.prompts, self.spec, self.total_steps = prompts, spec, total_steps
        self.timer = timer if timer is not None else PhaseTimer()
        self.release_memory = release_memory
        self.asynchronous, self.max_staleness, self.overlap_sync = asynchronous, max_staleness, overlap_sync
        self.sleeps = sleeps
        self.engine_version = version
        self.schedule_version = version  # the weights the staleness rule counts from: those of its last sync
        self.queue: list[_InFlight] = []  # the batch in flight, then finished ones of later steps (`quiesce`)
        self._confirmed: dict | None = None  # figures of a sync confirmed since the last batch
        self._report: dict | None = None  # what `take_report` returns next
        self._held = 0  # open `awake()` blocks

    @property
    def in_flight(self) -> _InFlight | None:
        """The batch the next `batch` call returns (generating or finished), or None."""
        return self.queue[0] if self.queue else None

    # ---- what a recipe calls ---------------------------------------------------------------------------------
    def start(self, version: int) -> dict:
        """The sync before the first rollout (it waits). A colocated engine that sleeps between phases is put to
        sleep first, so the sync wakes its weights only and the KV cache is not held while the trainer gathers its
        weights (an 8B run under a 24 GiB cap ran out of memory in this sync with the fresh engine's KV cache
        allocated). Returns the sync's report. The staleness rule counts from `version`, unless a checkpoint's
        batches were loaded (`load_state_dict`): then from the weights those batches' schedule synced last."""
        self._sleep()
        if not self.queue:
            self.schedule_version = version
        return self._sync(version)

    def batch(self, step: int, rows: list[dict] | None = None, spec: SamplingSpec | None = None) -> RolloutBatch:
        """The batch step `step` trains on, its weights' sync confirmed. Without `rows`: the step's prompts
        (`prompts()`) with `spec(step)`, or the batch in flight; in async mode step+1's batch is then submitted
        (after a sync when the staleness rule asks for one). With `rows` (and optionally `spec`): those rows,
        generated now (synchronous mode only, nothing in flight: dynamic sampling's rounds)."""
        if rows is not None:
            if self.asynchronous or self.queue:
                raise RuntimeError("RolloutService.batch(rows=...) generates at once: synchronous mode only, with "
                                   "no batch in flight")
            with self.timer.phase("rollout"):
                self._submit(rows, spec if spec is not None else self.spec(step), step)
                batch = self._collect()
            self._note(None)
            return batch
        report = None
        with self.timer.phase("rollout"):
            if not self.queue:
                self._submit(self.prompts(), self.spec(step), step)
            batch = self._collect()
        if self.asynchronous and step + 1 < self.total_steps and not self.queue:
            if step + 1 - self.schedule_version > self.max_staleness:  # the weights of the last sync are too old
                self.schedule_version = step
                if self.engine_version != step:  # an evaluation's sync or a resume's may have made it
                    report = self._sync(step, wait=not self.overlap_sync)
            with self.timer.phase("rollout"):
                self._submit(self.prompts(), self.spec(step + 1), step + 1)  # generates while this step trains
        self._note(report)
        return batch

    def publish(self, version: int) -> None:
        """The trainer's weights after `version` updates exist. Synchronous mode: synced now (without waiting, with
        `overlap_sync`, while another step follows: the next `batch` confirms it). Async mode: nothing moves here;
        `batch` syncs while the engine is idle, when the staleness rule asks for it."""
        if self.asynchronous:
            return
        more = version < self.total_steps
        self._report = merge_reports(self._report, self._sync(version, wait=not (self.overlap_sync and more)))

    def quiesce(self, version: int | None = None) -> dict | None:
        """Before an evaluation or a checkpoint: the batch in flight is collected and kept (the service then returns
        it as it would have), in async mode after it every batch the schedule would still generate with the engine's
        weights (`_generate_ahead`), and a sync made without waiting is confirmed, so nothing is owed by the engine.
        With `version`, an engine holding other weights is synced to them now (it waits); returns that sync's
        report, else None. Collective where the engine's calls are (every rank calls it at the same point)."""
        if self.queue:
            self.queue[-1].result.result()  # wait for it: it is part of the state
            self._generate_ahead()
        self._confirm()
        if version is not None and self.engine_version != version:
            return self._sync(version)
        return None

    def take_report(self) -> dict | None:
        """The reports of the syncs made and confirmed since the last call, merged (`merge_reports`), or None."""
        report, self._report = self._report, None
        return report

    def metrics(self) -> dict:
        """The rollout mode's own figures for the step's metrics (`rollout/...`); none here."""
        return {}

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Keep the engine awake across several `batch` calls (asleep at level 2 it would drop its weights between
        them); it sleeps, where it sleeps between phases, when the block ends."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        self._sleep()

    # ---- the replaceable part ------------------------------------------------------------------------------
    def generate(self, rows: list[dict], spec: SamplingSpec) -> Pending:
        """Start generating `rows`' samples (prompt-major, `spec.n` each) on the awake engine; `result()` of the
        returned `Pending` is `(samples, (seconds, tokens) or None)`. An engine in its own process generates while
        the caller goes on; an in-process one generates here. Override for another rollout mode (module
        docstring)."""
        ticket = self.engine.submit([list(r["input_ids"]) for r in rows], spec)
        if ticket.samples is not None:  # an in-process engine generated it just now
            return Pending.done((ticket.samples, self.engine.last_generate()))
        return Pending(lambda: (self.engine.collect(ticket), self.engine.last_generate()))

    # ---- inside ----------------------------------------------------------------------------------------------
    def _submit(self, rows: list[dict], spec: SamplingSpec, step: int) -> None:
        self._wake()
        self.queue.append(_InFlight(rows, self.generate(rows, spec), self.engine_version, step))

    def _collect(self) -> RolloutBatch:
        batch = _batch_of(self.queue.pop(0))
        self._confirm()  # the sync before this generation, if made without waiting: checked before it is returned
        self._sleep()
        return batch

    def _generate_ahead(self) -> None:
        """Async mode: generate now, one after the other, the batches of the steps after the last queued one that
        the schedule would generate with the engine's weights (those of `schedule_version`: up to step
        `schedule_version + max_staleness`), and keep them queued. After it the engine owes nothing to the
        schedule, so a checkpoint holds every batch the older weights make, and an evaluation's sync to newer
        weights changes no later batch (module docstring)."""
        last = self.queue[-1].step
        if not self.asynchronous or last is None or self.engine_version != self.schedule_version:
            return
        with self.timer.phase("rollout"):
            for step in range(last + 1, min(self.schedule_version + self.max_staleness, self.total_steps - 1) + 1):
                self._submit(self.prompts(), self.spec(step), step)
                self.queue[-1].result.result()
        self._sleep()

    def _confirm(self) -> None:
        """The one place a sync made without waiting is confirmed (`WeightSync.confirm`: the engine's
        acknowledgement and the canary's verdict, raising `SyncCanaryError`); its figures go into the next batch's
        report."""
        with self.timer.phase("sync"):
            confirmed = self.sync.confirm() if self.sync.pending else None
        if confirmed is not None:
            self._confirmed = confirmed

    def _sync(self, version: int, *, wait: bool = True) -> dict:
        self._confirm()
        with self.timer.phase("sync"):
            if self.sleeps and self.release_memory is not None:
                self.release_memory()
            report = self.sync.sync(wait=wait)
        self.engine_version = version
        return report

    def _note(self, report: dict | None) -> None:
        """A batch's sync report, then the confirmation made since the last batch, into the step's report."""
        self._report = merge_reports(self._report, report, self._confirmed)
        self._confirmed = None

    def _wake(self) -> None:
        """Wake a sleeping engine before it generates; an awake one is left alone (a call to a server would wait
        for every reply still owed, e.g. a weight update handed over without waiting)."""
        if self.engine.sleeping:
            self.engine.wake()

    def _sleep(self) -> None:
        if self.sleeps and not self._held:  # free it for training
            self.engine.sleep()

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batch in flight (`in_flight`: its rows, samples with their weights versions, the batch's weights
        version and step) or None, the finished batches of later steps (`ahead`, the same way) and
        `schedule_version`. Pure: call `quiesce()` first when a batch may still be generating (it raises then)."""
        if any(not job.result.ready for job in self.queue):
            raise RuntimeError("RolloutService.state_dict: the batch in flight is still generating; call quiesce() "
                               "first")
        jobs = [_saved(job) for job in self.queue]
        return {"in_flight": jobs[0] if jobs else None, "ahead": jobs[1:], "schedule_version": self.schedule_version}

    def load_state_dict(self, state: dict) -> None:
        jobs = [state["in_flight"], *state.get("ahead", [])] if state.get("in_flight") is not None else []
        self.queue = [_InFlight(job["rows"], Pending.done(([RolloutSample(*s) for s in job["samples"]], None)),
                                int(job["weights_version"]), job.get("step")) for job in jobs]
        oldest = self.queue[0].weights_version if self.queue else self.schedule_version
        self.schedule_version = int(state.get("schedule_version", oldest))


def _saved(job: _InFlight) -> dict:
    """A finished job as a checkpoint holds it (plain values, loadable with weights_only=True)."""
    batch = _batch_of(job)
    return {"rows": [plain_row(r) for r in batch.rows], "samples": [list(vars(s).values()) for s in batch.samples],
            "weights_version": batch.weights_version, "step": job.step}
