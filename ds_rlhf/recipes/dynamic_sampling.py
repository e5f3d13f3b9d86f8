"""DAPO's dynamic sampling, the RL step's stage 2b (`rl.dynamic_sampling`): `dynamic_batch`.

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

import torch

from ds_rlhf.algos.shaping import informative_groups
from ds_rlhf.distributed import agree_max
from ds_rlhf.recipes.reward_stage import merge_reward_metrics
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.recipes.rl_service import sampling_spec
from ds_rlhf.recipes.trajectory import ScoredBatch, take_groups
from ds_rlhf.rollout.service import RolloutService
from ds_rlhf.run.context import RunContext
from ds_rlhf.telemetry import PhaseTimer


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
            rows = service.prompts()  # the loader's position after every round is part of the state
            # generated now, the last step's sync confirmed first when it did not wait (overlap_sync)
            generated = service.batch(step, rows=rows, spec=sampling_spec(ctx, step, round_=len(rounds)))
            seconds, tokens = generated.generation or (0.0, 0)
            gen_seconds, gen_tokens = gen_seconds + seconds, gen_tokens + tokens
            with timer.phase("reward"):
                scored = parts.reward(generated, step=step)
            rounds.append(scored)
            if getattr(parts, "curriculum", None) is not None:  # rl.curriculum: every group, before any is dropped
                parts.curriculum.observe(scored)
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
