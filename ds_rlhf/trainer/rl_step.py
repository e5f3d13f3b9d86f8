"""One RL step, top to bottom. Each stage takes values and returns a new value; none writes into another's:

    prompt rows -> rollout -> RolloutBatch -> rewards (+ shaping) -> ScoredBatch -> trajectory (pad, old /
    reference log-probs, values, advantages) -> Trajectory -> update -> UpdateResult -> weight sync -> sync report
    (and, on the steps the sample log is due, a few samples as rows: `sample_rows`)

With dynamic sampling (`rl.dynamic_sampling`) the schedule runs rollout and rewards together, in rounds, and
hands over a ScoredBatch.

The rollout of a step depends only on its prompt rows and a weights version, so it can start before the previous
step's update ends: `rollout_schedule.py` generates and syncs (in lockstep, or one step ahead), this file turns a
generated batch into an update. Building the parts is `rl_build.py`; the loop (checkpoints, resume, logging) is
`rl_trainer.py`.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.kl import kl_penalty
from ds_rlhf.algos.mismatch import mismatch_metrics
from ds_rlhf.rollout.base import SamplingSpec
from ds_rlhf.rollout.stops import run_stop_token_ids
from ds_rlhf.telemetry import PhaseTimer
from ds_rlhf.trainer.rl_build import RLParts
from ds_rlhf.trainer.rl_update import UpdateResult, forward_logprobs, forward_values, ppo_update, single_update
from ds_rlhf.trainer.run_context import RunContext
from ds_rlhf.trainer.trajectory import RolloutBatch, ScoredBatch, Trajectory, pad_trajectory, with_advantages


def sampling_spec(ctx: RunContext, step: int, round_: int = 0) -> SamplingSpec:
    r = ctx.cfg.rollout
    # Distinct, reproducible seeds per (run seed, step, rank, dynamic-sampling round); the engine adds the prompt
    # index. Round 0 is every step's only round without dynamic sampling.
    seed = (ctx.cfg.run.seed * 1_000_003 + (step * ctx.dist.world_size + ctx.dist.rank) * 10_007
            + round_ * 1_000_000_007)
    return SamplingSpec(n=r.n_samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                        top_k=r.top_k, stop_token_ids=run_stop_token_ids(ctx), seed=seed, seeding=r.seeding)


def make_trajectory(parts: RLParts, ctx: RunContext, scored: ScoredBatch, *, kl_coef: float,
                    timer: PhaseTimer) -> Trajectory:
    """Pad the kept samples, add the forward passes the settings need, then the advantages."""
    cfg = ctx.cfg
    traj = pad_trajectory(scored.samples, scored.scores, ctx.tokenizer.pad_token_id, device=ctx.dist.device,
                          weights_version=scored.rollout.weights_version, mask_truncated=cfg.rl.overlong_mask)
    with timer.phase("old_logp"):
        if not single_update(cfg.rl):  # several updates per rollout batch need the pre-update policy's log-probs
            traj = traj.replace(old_logp=forward_logprobs(parts.actor, traj, cfg))
    with timer.phase("reference"):
        if parts.reference is not None:
            traj = traj.replace(ref_logp=forward_logprobs(parts.reference, traj, cfg))
    with timer.phase("critic"):
        if parts.critic is not None:
            traj = traj.replace(values=forward_values(parts.critic, traj, cfg))
    return with_advantages(traj, cfg.rl, kl_coef)


def step_metrics(ctx: RunContext, scored: ScoredBatch, traj: Trajectory, update: UpdateResult,
                 kl_coef: float) -> dict:
    mask = traj.action_mask
    lens = traj.response_lens.float()
    out = {**scored.metrics, **update.metrics,
           "response/len_mean": lens.mean(), "response/len_max": lens.max(), "response/len_p50": lens.median(),
           "rollout/tail_decode_frac": tail_decode_fraction(lens),
           "response/truncated_frac": (traj.response_lens >= ctx.cfg.rollout.max_new_tokens).float().mean(),
           "rollout/samples": len(traj), "kl/coef": kl_coef, "_tokens": float(traj.seq_lens.sum())}
    if ctx.cfg.rl.overlong_mask:  # rows whose loss weight is zero (truncated responses)
        out["response/loss_masked_frac"] = (mask.sum(1) == 0).float().mean()
    out.update(mismatch_metrics(update.trainer_logp, traj.rollout_logp, mask))
    if traj.ref_logp is not None:
        kl = kl_penalty(traj.behaviour_logp(), traj.ref_logp, "k1")
        out["kl/mean"] = (kl * mask).sum() / mask.sum().clamp(min=1)
    return out


def tail_decode_fraction(lens: torch.Tensor) -> torch.Tensor:
    """The share of a batch's decode iterations that run after half of its samples have finished: 1 - median / max
    response length. Samples start together and decode one token per iteration, so this is the part of the rollout
    spent waiting for the longest samples (exactly so where an iteration's cost does not depend on how many
    sequences are still running, as with a small model's CUDA-graph decode)."""
    longest = lens.max().clamp(min=1)
    return 1 - lens.median() / longest


def sample_rows(ctx: RunContext, scored: ScoredBatch, traj: Trajectory, k: int) -> list[dict]:
    """Up to `k` kept samples as `telemetry.samples.SampleLogger` rows: every prompt's first sample before any
    prompt's second. `advantage` is the masked mean of the sample's token advantages."""
    samples, rows = scored.samples, scored.rollout.rows
    chosen = sorted(range(len(samples)), key=lambda i: (samples[i].sample_index, i))[:k]
    if not chosen:
        return []
    index = torch.tensor(chosen, device=traj.action_mask.device)
    mask = traj.action_mask[index]
    advantages = ((traj.advantages[index] * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    out = []
    for i, advantage in zip(chosen, advantages):
        s, row = samples[i], rows[samples[i].prompt_index]
        out.append({"prompt": row.get("prompt_text") or ctx.tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                    "response": scored.texts[i], "reward": float(scored.scores[i]),
                    "reward_components": {name: values[i] for name, values in scored.components.items()},
                    "ground_truth": row.get("ground_truth"), "advantage": float(advantage),
                    "weights_version": scored.rollout.weights_version, "data_source": row.get("data_source"),
                    "sample_index": s.sample_index, "prompt_index": s.prompt_index,
                    "finish_reason": s.finish_reason})
    return out


def run_step(parts: RLParts, ctx: RunContext, batch: RolloutBatch | ScoredBatch, *, step: int, kl_coef: float,
             generator: torch.Generator, timer: PhaseTimer, samples: int = 0) -> tuple[dict, list[dict]]:
    """One step's training on a generated batch (`rollout_schedule.RolloutSchedule.next_batch` makes it):
    rewards -> trajectory -> update; returns the step's metrics on this rank and `samples` sample rows for the
    sample log (none when `samples` is 0: rows are built only when the log is due). A batch that comes scored
    (dynamic sampling chose its prompts by their rewards) skips the reward stage."""
    if isinstance(batch, ScoredBatch):
        scored = batch
    else:
        with timer.phase("reward"):
            scored = parts.reward(batch, step=step)
    traj = make_trajectory(parts, ctx, scored, kl_coef=kl_coef, timer=timer)
    with timer.phase("train"):
        update = ppo_update(parts.actor, parts.critic, traj, ctx.cfg, kl_coef=kl_coef, generator=generator)
    metrics = step_metrics(ctx, scored, traj, update, kl_coef)
    metrics["rollout/staleness"] = step - scored.rollout.weights_version
    metrics.update(generation_metrics(scored.rollout))
    return metrics, (sample_rows(ctx, scored, traj, samples) if samples > 0 else [])


def generation_metrics(batch: RolloutBatch) -> dict:
    """`rollout/generate_seconds` and `rollout/generate_tokens_per_s`: the engine's own time for the call(s) that
    made this batch (every dynamic-sampling round) and the response tokens per second it generated in them, all
    ranks' where one engine served several (tensor-parallel, a server): per engine, comparable with plain vLLM's.
    With overlap the trainer waits less than that. Empty when unknown (a batch restored from a checkpoint)."""
    if batch.generation is None or batch.generation[0] <= 0:
        return {}
    seconds, tokens = batch.generation
    return {"rollout/generate_seconds": seconds, "rollout/generate_tokens_per_s": tokens / seconds}


def update_kl_controller(kl_ctl, metrics: dict, world_size: int) -> float:
    """Move the KL coefficient after a step: Ziegler et al. 2019's n is the number of samples the step trained
    on over all ranks (`metrics` are already averaged over ranks). Returns the new coefficient."""
    samples = int(round(float(metrics.get("rollout/samples", 0.0)) * world_size))
    return kl_ctl.update(float(metrics.get("kl/mean", 0.0)), n_steps=samples)
