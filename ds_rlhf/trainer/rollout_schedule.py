"""When batches are generated relative to updates, and when the rollout engine gets new weights.

Synchronous (default, exact on-policy): generate step k's batch with the weights after k updates, train, sync.

Asynchronous (`rollout.async_generation`): step k+1's batch is submitted to the engine *before* step k trains,
so an engine in its own process (`rollout.placement` sidecar / disaggregated) generates while DeepSpeed trains.
Every batch carries the weights version it was generated with; the trainer's mismatch correction (TIS / MIS)
weighs it against the rollout policy, and `rollout/staleness` (updates between generation and training) is
logged per step. The engine gets new weights only while it is idle (between a collect and the next submit),
whenever the next batch would otherwise be more than `rollout.max_staleness` updates old.

Checkpoints: the batch in flight is collected and saved with the trainer state (its rows, samples and weights
version), so a resumed run trains on exactly the batch the interrupted run would have (resume is exact for
`max_staleness` 1; with more, the resumed engine holds newer weights than the interrupted one did).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_rlhf.rollout.base import RolloutSample, RolloutTicket
from ds_rlhf.telemetry import PhaseTimer
from ds_rlhf.trainer.rl_build import RLParts
from ds_rlhf.trainer.run_context import RunContext
from ds_rlhf.trainer.trajectory import RolloutBatch


@dataclass
class _InFlight:
    rows: list[dict]
    ticket: RolloutTicket
    weights_version: int


def _plain(value):
    """Store rows hold numpy arrays; checkpoints hold plain lists (loadable with weights_only=True)."""
    return value.tolist() if hasattr(value, "tolist") else value


class RolloutSchedule:
    def __init__(self, parts: RLParts, ctx: RunContext, timer: PhaseTimer, *, start_step: int):
        self.parts, self.ctx, self.timer = parts, ctx, timer
        r = ctx.cfg.rollout
        self.asynchronous, self.max_staleness = r.async_generation, r.max_staleness
        self.engine_version = start_step  # the trainer synced its weights into the engine at start
        self.in_flight: _InFlight | None = None

    def _submit(self, step: int) -> None:
        from ds_rlhf.trainer.rl_step import sampling_spec

        rows = next(self.parts.loader_iter)
        self.parts.rollout.wake()
        ticket = self.parts.rollout.submit([list(r["input_ids"]) for r in rows], sampling_spec(self.ctx, step))
        self.in_flight = _InFlight(rows, ticket, self.engine_version)

    def _collect(self) -> RolloutBatch:
        job, self.in_flight = self.in_flight, None
        samples = self.parts.rollout.collect(job.ticket)
        r = self.ctx.cfg.rollout
        if self.ctx.dist.device.type == "cuda" and r.sleep and r.placement == "colocated":  # free it for training
            self.parts.rollout.sleep()
        return RolloutBatch(rows=job.rows, samples=samples, weights_version=job.weights_version)

    def sync(self, weights_version: int) -> dict:
        with self.timer.phase("sync"):
            report = self.parts.sync.sync()
        self.engine_version = weights_version
        return report

    def next_batch(self, step: int, total_steps: int) -> tuple[RolloutBatch, dict | None]:
        """The batch step `step` (0-based, the weights after `step` updates) trains on, and the report of a sync
        made meanwhile (async mode) or None."""
        report = None
        with self.timer.phase("rollout"):
            if self.in_flight is None:
                self._submit(step)
            batch = self._collect()
        if self.asynchronous and step + 1 < total_steps:
            if step + 1 - self.engine_version > self.max_staleness:
                report = self.sync(step)
            with self.timer.phase("rollout"):
                self._submit(step + 1)  # generates while this step trains
        return batch, report

    def after_update(self, weights_version: int) -> dict | None:
        """Synchronous mode: the engine gets the new weights right after the update."""
        return None if self.asynchronous else self.sync(weights_version)

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.in_flight is None:
            return {"in_flight": None}
        job = self.in_flight
        samples = self.parts.rollout.collect(job.ticket)  # wait for it: it is part of the state
        job.ticket = RolloutTicket(samples=samples)
        return {"in_flight": {"rows": [{k: _plain(v) for k, v in r.items()} for r in job.rows],
                              "samples": [list(vars(s).values()) for s in samples],
                              "weights_version": job.weights_version}}

    def load_state_dict(self, state: dict) -> None:
        job = state.get("in_flight")
        if job is not None:
            samples = [RolloutSample(*s) for s in job["samples"]]
            self.in_flight = _InFlight(job["rows"], RolloutTicket(samples=samples), int(job["weights_version"]))
