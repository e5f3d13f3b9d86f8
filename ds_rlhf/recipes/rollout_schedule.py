"""The recipe's side of the rollout: what only the recipe knows, handed to the rollout layer's `RolloutService`
(`ds_rlhf/rollout/service.py`, which owns the engine, the weight sync and when each runs).

- `sampling_spec`: the `SamplingSpec` of a step (and of a dynamic-sampling round), from the run's config.
- `release_trainer_memory`: the trainer's roles' cached device memory, freed before a sleeping colocated engine
  wakes its weights for a sync.
- `rollout_service`: the run's service, built from the parts and the config; `eval_generate`: what held-out
  evaluation generates with (the episode service's episodes with `env.name`).
- `dynamic_batch`: DAPO's dynamic sampling, which needs the rewards.

Dynamic sampling (`rl.dynamic_sampling`, DAPO; synchronous mode only, `config_rules` refuses it with async
generation): a step's batch is generated and scored in rounds. Each round draws the loader's next
`rl.prompts_per_step` prompts, has the service generate them (`RolloutService.batch(step, rows=..., spec=...)`,
which confirms the last step's sync first when it did not wait) and scores them; prompts whose samples all got
the same raw reward (zero spread: every sample's group-relative advantage would be 0) are dropped, the others kept
in order, until `rl.prompts_per_step` prompts are kept or `rl.dynamic_sampling_max_rounds` rounds have run. Every
rank runs the same number of rounds (they agree with `agree_max`: generation and scoring hold collectives), so
every rank's loader stays at the same position and that position, saved with the checkpoint, resumes exactly. A
step left short trains on the prompts it kept (on all of the first round's, with zero advantages, when it kept
none). `rollout/dynamic_rounds` and `rollout/zero_spread_groups` say what it took.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import torch

from ds_rlhf.agent.rollout import EpisodeRolloutService
from ds_rlhf.algos.shaping import informative_groups
from ds_rlhf.distributed import agree_max
from ds_rlhf.recipes.reward_stage import merge_reward_metrics
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.recipes.rl_eval import GenerateRows
from ds_rlhf.recipes.trajectory import ScoredBatch, take_groups
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


def rollout_service(parts: RLParts, ctx: RunContext, timer: PhaseTimer) -> RolloutService:
    """The run's `RolloutService` over `parts.rollout` and `parts.sync`: prompts from `parts.loader_iter` (read at
    each draw), `sampling_spec` per step, the `rollout.*` schedule settings and `run.steps`; with `env.name`
    an `agent/rollout.py:EpisodeRolloutService`, whose batches are multi-turn episodes; with
    `rollout.partial_tokens` a `rollout/partial.py:PartialRolloutService` (partial rollouts)."""
    r = ctx.cfg.rollout
    args = (parts.rollout, parts.sync)
    kwargs = dict(prompts=lambda: next(parts.loader_iter), spec=partial(sampling_spec, ctx),
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


def eval_generate(service: RolloutService) -> GenerateRows | None:
    """What held-out evaluation generates with (`rl_eval.RunEvaluation.run`): with `env.name` the episode
    service's `play` (episodes with the run's environment on the same engine), else None (the engine's single
    turns)."""
    return service.play if isinstance(service, EpisodeRolloutService) else None


def dynamic_batch(service: RolloutService, parts: RLParts, ctx: RunContext, timer: PhaseTimer,
                  step: int) -> ScoredBatch:
    """DAPO's dynamic sampling (see the module docstring): generation and scoring rounds until the step has
    `rl.prompts_per_step` prompts whose samples' raw rewards differ; returns them scored. The engine stays awake
    between rounds (asleep at level 2 it would have dropped its weights) and sleeps after the last."""
    rl, device = ctx.cfg.rl, ctx.dist.device
    need = rl.prompts_per_step
    rounds: list[ScoredBatch] = []
    picks: list[tuple[ScoredBatch, int]] = []
    zero_spread, gen_seconds, gen_tokens = 0, 0.0, 0
    with service.awake():  # between rounds; it sleeps after the last
        while True:
            rows = next(parts.loader_iter)  # the loader's position after every round is part of the state
            # generated now, the last step's sync confirmed first when it did not wait (overlap_sync)
            generated = service.batch(step, rows=rows, spec=sampling_spec(ctx, step, round_=len(rounds)))
            seconds, tokens = generated.generation or (0.0, 0)
            gen_seconds, gen_tokens = gen_seconds + seconds, gen_tokens + tokens
            with timer.phase("reward"):
                scored = parts.reward(generated, step=step)
            rounds.append(scored)
            ok = informative_groups(torch.tensor(scored.raw(), dtype=torch.float64),
                                    torch.tensor([s.prompt_index for s in scored.samples], dtype=torch.long),
                                    len(rows)).tolist()
            picks += [(scored, p) for p in range(len(rows)) if ok[p]]
            zero_spread += len(rows) - sum(ok)
            short = int(len(picks) < need)
            if len(rounds) >= rl.dynamic_sampling_max_rounds or not agree_max(short, device):
                break
    kept = min(len(picks), need)
    if kept < need:
        ctx.print(f"[rl] dynamic sampling, step {step + 1}: {kept} of {need} prompts with differing rewards after "
                  f"{len(rounds)} rounds (rl.dynamic_sampling_max_rounds); training on "
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

