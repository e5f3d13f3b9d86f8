"""When batches are generated relative to updates, and when the rollout engine gets new weights.

Synchronous (default, exact on-policy): generate step k's batch with the weights after k updates, train, sync.

Asynchronous (`rollout.async_generation`): step k+1's batch is submitted to the engine *before* step k trains,
so an engine in its own process (`rollout.placement` sidecar / disaggregated) generates while DeepSpeed trains.
Every batch carries the weights version it was generated with; the trainer's mismatch correction (TIS / MIS)
weighs it against the rollout policy, and `rollout/staleness` (updates between generation and training) is
logged per step. The engine gets new weights only while it is idle (between a collect and the next submit),
whenever the next batch would otherwise be more than `rollout.max_staleness` updates old. With
`rollout.overlap_sync` (default) that sync does not wait for the engine (`WeightSync.sync(wait=False)`): the
trainer hands the weights over, sends the canary's probe, submits the next batch and trains, while the engine loads,
scores the probe, then generates. The engine's acknowledgement and the canary's verdict are read when that batch is
collected, before anything trains on it (`WeightSync.confirm`); their figures are logged with the step that trains
on the batch (`sync/canary_*`, `sync/confirm_seconds`), the handover's with the step that made it (`sync/seconds`).
In synchronous mode `rollout.overlap_sync` hands over the same way after every update but the last: the engine
loads before it generates the next batch, so the batches are those of a waited sync, and the trainer's wait for
that batch includes the load. Evaluation and dynamic-sampling rounds confirm before they use the engine.

Dynamic sampling (`rl.dynamic_sampling`, DAPO; synchronous mode only, `RLConfig` refuses it with async
generation): a step's batch is generated and scored in rounds. Each round draws the loader's next
`rl.prompts_per_step` prompts, generates and scores them; prompts whose samples all got the same raw reward (zero
spread: every sample's group-relative advantage would be 0) are dropped, the others kept in order, until
`rl.prompts_per_step` prompts are kept or `rl.dynamic_sampling_max_rounds` rounds have run. Every rank runs the same
number of rounds (they agree with `agree_max`: generation and scoring hold collectives), so every rank's loader stays
at the same position and that position, saved with the checkpoint, resumes exactly. A step left short trains on the
prompts it kept (on all of the first round's, with zero advantages, when it kept none).
`rollout/dynamic_rounds` and `rollout/zero_spread_groups` say what it took.

Checkpoints: the batch in flight is collected and saved with the trainer state (its rows, samples and weights
version), so a resumed run trains on exactly the batch the interrupted run would have (resume is exact for
`max_staleness` 1; with more, the resumed engine holds newer weights than the interrupted one did).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ds_rlhf.algos.shaping import informative_groups
from ds_rlhf.distributed import agree_max
from ds_rlhf.recipes.reward_stage import merge_reward_metrics
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.recipes.trajectory import RolloutBatch, ScoredBatch, take_groups
from ds_rlhf.rollout.base import RolloutSample, RolloutTicket, SamplingSpec
from ds_rlhf.rollout.stops import run_stop_token_ids
from ds_rlhf.run.context import RunContext
from ds_rlhf.telemetry import PhaseTimer

log = logging.getLogger(__name__)


def sampling_spec(ctx: RunContext, step: int, round_: int = 0) -> SamplingSpec:
    r = ctx.cfg.rollout
    # Distinct, reproducible seeds per (run seed, step, rank, dynamic-sampling round); the engine adds the prompt
    # index. Round 0 is every step's only round without dynamic sampling.
    seed = (ctx.cfg.run.seed * 1_000_003 + (step * ctx.dist.world_size + ctx.dist.rank) * 10_007
            + round_ * 1_000_000_007)
    return SamplingSpec(n=r.n_samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                        top_k=r.top_k, stop_token_ids=run_stop_token_ids(ctx), seed=seed, seeding=r.seeding)


@dataclass
class _InFlight:
    rows: list[dict]
    ticket: RolloutTicket
    weights_version: int
    generation: tuple[float, int] | None = None  # the engine's (seconds, tokens), once known (None: restored)


def _plain(value):
    """Store rows hold numpy arrays; checkpoints hold plain lists (loadable with weights_only=True)."""
    return value.tolist() if hasattr(value, "tolist") else value


def merge_reports(*reports: dict | None) -> dict | None:
    """Sync reports of one step as one (a handover and the confirmation of an earlier sync): later values win, but
    None never hides a value (a handover's canary figure, not known yet, leaves the confirmed one). None if empty."""
    out: dict = {}
    for report in reports:
        for key, value in (report or {}).items():
            if value is not None or key not in out:
                out[key] = value
    return out or None


class RolloutSchedule:
    def __init__(self, parts: RLParts, ctx: RunContext, timer: PhaseTimer, *, start_step: int):
        self.parts, self.ctx, self.timer = parts, ctx, timer
        r = ctx.cfg.rollout
        self.asynchronous, self.max_staleness = r.async_generation, r.max_staleness
        self.engine_version = start_step  # the trainer synced its weights into the engine at start
        self.overlap_sync = r.overlap_sync
        self.in_flight: _InFlight | None = None
        self._confirmed: dict | None = None  # figures of a sync confirmed since the last report
        self.dynamic = ctx.cfg.rl.dynamic_sampling

    def _submit(self, step: int) -> None:
        rows = next(self.parts.loader_iter)
        self._wake()
        ticket = self.parts.rollout.submit([list(r["input_ids"]) for r in rows], sampling_spec(self.ctx, step))
        self.in_flight = _InFlight(rows, ticket, self.engine_version)
        if ticket.samples is not None:  # an in-process engine generated it just now
            self.in_flight.generation = self.parts.rollout.last_generate()

    def _take(self, job: _InFlight) -> list:
        """`job`'s samples, waiting for them if they are still generating (then noting the engine's time)."""
        pending = job.ticket.samples is None
        samples = self.parts.rollout.collect(job.ticket)
        if pending:
            job.generation = self.parts.rollout.last_generate()
        self._confirm()  # the sync before this generation, if made without waiting: checked now
        return samples

    def _confirm(self) -> None:
        """Check a sync made without waiting (`WeightSync.confirm`; a no-op when there is none); its figures go
        into the next report."""
        with self.timer.phase("sync"):
            confirmed = self.parts.sync.confirm()
        if confirmed is not None:
            self._confirmed = confirmed

    def _collect(self) -> RolloutBatch:
        job, self.in_flight = self.in_flight, None
        samples = self._take(job)
        self._sleep()
        return RolloutBatch(rows=job.rows, samples=samples, weights_version=job.weights_version,
                            generation=job.generation)

    def _sleeps(self) -> bool:
        r = self.ctx.cfg.rollout
        return self.ctx.dist.device.type == "cuda" and r.sleep and r.placement == "colocated"

    def _wake(self) -> None:
        """Wake a sleeping engine before it generates; an awake one is left alone (a call to a server would wait
        for every reply still owed, e.g. a weight update handed over without waiting)."""
        if self.parts.rollout.sleeping:
            self.parts.rollout.wake()

    def _sleep(self) -> None:
        if self._sleeps():  # free it for training
            self.parts.rollout.sleep()

    def _release_trainer_memory(self) -> None:
        """Before a sleeping colocated engine wakes its weights: ZeRO-3 keeps some gathered parameters on the
        device between passes (`empty_partition_cache` drops them; the next pass fetches them again), and the
        allocator's cached blocks go back to the driver. At 8B under a 24 GiB cap the sync's gathers did not fit
        beside the woken weights without this."""
        if not self._sleeps():
            return
        for role in ("actor", "critic", "reference"):
            release = getattr(getattr(self.parts, role, None), "empty_partition_cache", None)
            if callable(release):
                release()
        if not torch.cuda.is_available():
            return
        torch.cuda.empty_cache()
        log.info("before weight sync: trainer allocated %.2f GiB, reserved %.2f GiB",
                 torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30)

    def _dynamic_batch(self, step: int) -> ScoredBatch:
        """DAPO's dynamic sampling (see the module docstring): generation and scoring rounds until the step has
        `rl.prompts_per_step` prompts whose samples' raw rewards differ; returns them scored. The engine stays awake
        between rounds (asleep at level 2 it would have dropped its weights) and sleeps after the last."""
        rl, device = self.ctx.cfg.rl, self.ctx.dist.device
        need = rl.prompts_per_step
        rounds: list[ScoredBatch] = []
        picks: list[tuple[ScoredBatch, int]] = []
        zero_spread, gen_seconds, gen_tokens = 0, 0.0, 0
        while True:
            rows = next(self.parts.loader_iter)  # the loader's position after every round is part of the state
            with self.timer.phase("rollout"):
                self._wake()
                ticket = self.parts.rollout.submit([list(r["input_ids"]) for r in rows],
                                                   sampling_spec(self.ctx, step, round_=len(rounds)))
                samples = self.parts.rollout.collect(ticket)
            if not rounds:  # the last step's sync, when it did not wait (overlap_sync): before anything trains
                self._confirm()
            seconds, tokens = self.parts.rollout.last_generate() or (0.0, 0)
            gen_seconds, gen_tokens = gen_seconds + seconds, gen_tokens + tokens
            with self.timer.phase("reward"):
                scored = self.parts.reward(RolloutBatch(rows=rows, samples=samples,
                                                        weights_version=self.engine_version), step=step)
            rounds.append(scored)
            ok = informative_groups(torch.tensor(scored.raw(), dtype=torch.float64),
                                    torch.tensor([s.prompt_index for s in scored.samples], dtype=torch.long),
                                    len(rows)).tolist()
            picks += [(scored, p) for p in range(len(rows)) if ok[p]]
            zero_spread += len(rows) - sum(ok)
            short = int(len(picks) < need)
            if len(rounds) >= rl.dynamic_sampling_max_rounds or not agree_max(short, device):
                break
        self._sleep()
        kept = min(len(picks), need)
        if kept < need:
            self.ctx.print(f"[rl] dynamic sampling, step {step + 1}: {kept} of {need} prompts with differing "
                           f"rewards after {len(rounds)} rounds (rl.dynamic_sampling_max_rounds); training on "
                           + ("those" if kept else "the first round's prompts (all zero advantages)"))
        if not picks:
            picks = [(rounds[0], p) for p in sorted({s.prompt_index for s in rounds[0].samples})]
        batch = take_groups(picks[:need], merge_reward_metrics(rounds))
        batch = dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout, generation=(gen_seconds,
                                                                                                  gen_tokens)))
        trained = batch.raw_scores
        return dataclasses.replace(batch, metrics={
            **batch.metrics, "reward/trained_mean": sum(trained) / len(trained) if trained else 0.0,
            "rollout/dynamic_rounds": float(len(rounds)), "rollout/zero_spread_groups": float(zero_spread),
            "rollout/kept_groups": float(kept)})

    def first_sync(self, weights_version: int) -> dict:
        """The sync before the first rollout. A colocated engine that sleeps between phases is put to sleep first,
        so the sync wakes its weights only and the KV cache is not held while the trainer gathers its weights (an
        8B run under a 24 GiB cap ran out of memory in this sync with the fresh engine's KV cache allocated)."""
        self._sleep()
        return self.sync(weights_version)

    def sync(self, weights_version: int, *, wait: bool = True) -> dict:
        with self.timer.phase("sync"):
            self._release_trainer_memory()
            report = self.parts.sync.sync(wait=wait)
        self.engine_version = weights_version
        return report

    def next_batch(self, step: int, total_steps: int) -> tuple[RolloutBatch | ScoredBatch, dict | None]:
        """The batch step `step` (0-based, the weights after `step` updates) trains on, and the report of a sync
        made meanwhile (async mode) or None. With dynamic sampling the batch comes scored (a `ScoredBatch`: the
        rounds needed rewards to choose prompts), and `rl.RLTrainer.train_step` skips its reward stage."""
        if self.dynamic:  # synchronous mode only (RLConfig refuses it with async generation)
            batch = self._dynamic_batch(step)
            report, self._confirmed = self._confirmed, None
            return batch, report
        report = None
        with self.timer.phase("rollout"):
            if self.in_flight is None:
                self._submit(step)
            batch = self._collect()
        if self.asynchronous and step + 1 < total_steps:
            if step + 1 - self.engine_version > self.max_staleness:
                report = self.sync(step, wait=not self.overlap_sync)
            with self.timer.phase("rollout"):
                self._submit(step + 1)  # generates while this step trains
        report, self._confirmed = merge_reports(report, self._confirmed), None  # the canary of the weights
        return batch, report                                                    # that generated this batch

    def after_update(self, weights_version: int) -> dict | None:
        """Synchronous mode: the engine gets the new weights right after the update. With `rollout.overlap_sync`
        the sync does not wait for an engine that can defer (a sidecar or server on one rank) while another step
        follows: the engine runs its commands in order, so it loads the weights (and scores the canary's probe)
        before it generates the next batch, and `_take` confirms both when that batch is collected, before it
        trains. The batches are those of a sync that waited. The last step's sync waits (no later collect would
        check it); a run stopped by a signal after a handover exits without checking it, as nothing generates
        after it. A failed load or canary is then raised in the next step, after this one was logged (and maybe
        saved: the trainer's own weights, unaffected)."""
        if self.asynchronous:
            return None
        more = weights_version < self.ctx.cfg.run.steps
        return self.sync(weights_version, wait=not (self.overlap_sync and more))

    def settle(self) -> None:
        """For a caller that generates outside the schedule (evaluation): the batch in flight collected and kept
        (as `state_dict` does: the schedule then trains on it as it would have) and a sync made without waiting
        confirmed, so the engine is idle and known to hold the trainer's weights."""
        if self.in_flight is not None:
            self.state_dict()  # its collect confirms the sync made before that generation
        else:
            self._confirm()

    # ---- checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.in_flight is None:
            return {"in_flight": None}
        job = self.in_flight
        samples = self._take(job)  # wait for it: it is part of the state
        job.ticket = RolloutTicket(samples=samples)
        return {"in_flight": {"rows": [{k: _plain(v) for k, v in r.items()} for r in job.rows],
                              "samples": [list(vars(s).values()) for s in samples],
                              "weights_version": job.weights_version}}

    def load_state_dict(self, state: dict) -> None:
        job = state.get("in_flight")
        if job is not None:
            samples = [RolloutSample(*s) for s in job["samples"]]
            self.in_flight = _InFlight(job["rows"], RolloutTicket(samples=samples), int(job["weights_version"]))
