"""What the RL recipe hands the rollout layer's `RolloutService` (`ds_rlhf/rollout/service.py`, which owns the
engine, the weight sync and when each runs): the service itself, built from the parts and the config
(`rollout_service`) with its prompt draws (`timed_draw`), the `SamplingSpec` of each step and dynamic-sampling
round (`sampling_spec`), and the release of the trainer's cached device memory the service calls before a sleeping
colocated engine wakes its weights for a sync (`release_trainer_memory`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial

import torch

from ds_rlhf.agent.rollout import EpisodeRolloutService
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.rollout.base import SamplingSpec
from ds_rlhf.rollout.partial import PartialRolloutService
from ds_rlhf.rollout.service import RolloutService
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


def sleeps_between_phases(ctx: RunContext) -> bool:
    """A colocated engine on a GPU with `rollout.sleep`: it sleeps while the trainer trains."""
    r = ctx.cfg.rollout
    return ctx.dist.device.type == "cuda" and r.sleep and r.placement == "colocated"


def release_trainer_memory(parts: RLParts) -> None:
    """Before a sleeping colocated engine wakes its weights: ZeRO-3 keeps some gathered parameters on the device
    between passes (`empty_partition_cache` drops them; the next pass fetches them again), and the allocator's
    cached blocks go back to the driver. At 8B under a 24 GiB cap the sync's gathers did not fit beside the woken
    weights without this."""
    for role in ("actor", "critic", "reference"):
        release = getattr(getattr(parts, role, None), "empty_partition_cache", None)
        if callable(release):
            release()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    log.info("before weight sync: trainer allocated %.2f GiB, reserved %.2f GiB",
             torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30)


def timed_draw(rows: Iterator[list[dict]], timer: PhaseTimer) -> Callable[[], list[dict]]:
    """The service's `prompts()`: the next prompt rows of `rows`, each draw charged to the timer's `data` phase. The
    service draws inside its `rollout` phase; PhaseTimer charges nested phases exclusively, so the draw's seconds
    move from `time/rollout` to `time/data` and `time/step` still counts them once."""

    def draw() -> list[dict]:
        with timer.phase("data"):
            return next(rows)

    return draw


def rollout_service(parts: RLParts, ctx: RunContext, timer: PhaseTimer) -> RolloutService:
    """The run's `RolloutService` over `parts.rollout` and `parts.sync`: prompts from `parts.loader_iter`
    (`timed_draw`), `sampling_spec` per step, the `rollout.*` schedule settings and `run.steps`; with `env.name`
    an `agent/rollout.py:EpisodeRolloutService`, whose batches are multi-turn episodes; with
    `rollout.partial_tokens` a `rollout/partial.py:PartialRolloutService` (partial rollouts)."""
    r = ctx.cfg.rollout
    args = (parts.rollout, parts.sync)
    kwargs = dict(prompts=timed_draw(parts.loader_iter, timer), spec=partial(sampling_spec, ctx),
                  total_steps=ctx.cfg.run.steps, timer=timer, release_memory=partial(release_trainer_memory, parts),
                  asynchronous=r.async_generation, max_staleness=r.max_staleness, overlap_sync=r.overlap_sync,
                  sleeps=sleeps_between_phases(ctx))
    if parts.environment is not None:  # env.name: the batch is multi-turn episodes
        return EpisodeRolloutService(*args, tokenizer=ctx.tokenizer, env_factory=parts.environment,
                                     max_turns=ctx.cfg.env.max_turns, step_timeout=ctx.cfg.env.step_timeout,
                                     lockstep=ctx.cfg.env.rounds == "lockstep",
                                     max_total_tokens=ctx.cfg.env.max_tokens or ctx.cfg.context_len(), **kwargs)
    if r.partial_tokens:
        return PartialRolloutService(*args, chunk=r.partial_tokens, **kwargs)
    return RolloutService(*args, **kwargs)
