"""The RL recipe: the loop (`RLTrainer`: `run.steps` steps, checkpoints every `run.save_every` steps and at the end,
exact resume from `run.resume`, metrics averaged over ranks and logged; held-out evaluation before training and
every `run.eval_every` steps, the best checkpoint by `eval.best_metric`, a few samples every `run.sample_log_every`
steps) and one step, `RLTrainer.train_step`, in numbered stages that docs/ARCHITECTURE.md's table follows:
    1  rollout      prompt rows -> RolloutBatch (`rollout/service.py:RolloutService.batch`: in lockstep, or one
                    step ahead)
    2  rewards      RolloutBatch -> ScoredBatch (`reward_stage.py`, with shaping)
    2b              dynamic sampling (`rl.dynamic_sampling`): rounds of 1 and 2 hand over a ScoredBatch
    3  trajectory   ScoredBatch -> Trajectory (pad, old / reference log-probs, values, advantages)
    4  update       Trajectory -> UpdateResult (`policy_update.py`)
    5  publish      the new weights to the rollout engine (`RolloutService.publish`)
    6  metrics      the step's metrics, averaged over ranks; the KL controller moves; sample rows when due

Each stage takes values and returns a new value; none writes into another's. Building the parts is `rl_build.py`;
held-out evaluation is `rl_eval.py`; the formulas live in `ds_rlhf.algos`. The operator extras (environment.json,
status.json, health warnings, the live metrics endpoint) are `run.monitor.RunMonitor`; signals, shut-down and exit
are `run.lifecycle.RunLifecycle`, shared with the supervised loop.
"""

from __future__ import annotations

import time

import torch

from ds_rlhf.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty
from ds_rlhf.algos.mismatch import mismatch_metrics
from ds_rlhf.config import Config
from ds_rlhf.distributed import all_reduce_mean
from ds_rlhf.memory.profile import MemoryProfiler
from ds_rlhf.recipes import rl_build, rl_export
from ds_rlhf.recipes.dynamic_sampling import dynamic_batch
from ds_rlhf.recipes.nonfinite import guard_step
from ds_rlhf.recipes.policy_update import UpdateResult, forward_logprobs, forward_values, policy_update
from ds_rlhf.recipes.rl_build import RLParts
from ds_rlhf.recipes.rl_eval import RunEvaluation, eval_generate
from ds_rlhf.recipes.rl_service import rollout_service
from ds_rlhf.recipes.rollout_precision import check_rollout_precision, mixed_precision_note
from ds_rlhf.recipes.trajectory import (
    RolloutBatch,
    ScoredBatch,
    Trajectory,
    pad_trajectory,
    staleness_metrics,
    with_advantages,
)
from ds_rlhf.rewards.bounded_http import Interrupted, clear_interrupt, interrupt
from ds_rlhf.run.checkpoint.best import BestCheckpointTracker, keep_best
from ds_rlhf.run.checkpoint.manager import CheckpointManager
from ds_rlhf.run.context import RunContext, setup_run
from ds_rlhf.run.gpu_split import start_split
from ds_rlhf.run.lifecycle import RunLifecycle
from ds_rlhf.run.preflight import check_rl_run, rl_eval_on
from ds_rlhf.telemetry import PhaseTimer, system_stats
from ds_rlhf.telemetry.logger import truncate_metrics
from ds_rlhf.telemetry.samples import SampleLogger, episode_fields, truncate_samples

PROGRESS_KEYS = ("reward/mean", "reward/exact_match", "actor/entropy", "mismatch/kl_rollout_trainer", "time/wall",
                 "eval/pass@1")


class RLTrainer:
    def __init__(self, cfg: Config, rollout=None):
        self.cfg = cfg
        self.split = start_split(cfg)  # rollout.sm_split: before anything initialises CUDA in this process
        try:
            self._start(cfg, rollout)
        except BaseException:
            self.split.close()
            raise

    def _start(self, cfg: Config, rollout) -> None:
        check_rl_run(cfg)  # inputs on disk, before any process group, engine or vLLM starts
        self.ctx: RunContext = setup_run(cfg, "rl")
        self.step = 0
        # a signal stops the remote rewards' requests too (`interrupt`); a request it cut ends the step unsaved
        self.lifecycle = RunLifecycle(self.ctx, "rl", cfg.run.steps, save=self._save, step=lambda: self.step,
                                      on_signal=(interrupt,), on_exit=(clear_interrupt, self.split.close),
                                      cut_short=(Interrupted,))
        self.monitor = self.lifecycle.monitor  # status.json, health warnings, live metrics
        self.lifecycle.build(lambda: self._build(rollout))

    def _build(self, rollout) -> None:
        cfg = self.cfg
        if rollout is None:
            check_rollout_precision(cfg, self.ctx)
        if (note := mixed_precision_note(cfg, self.ctx)) is not None:
            self.ctx.print(note)
        self.ckpt = CheckpointManager(self.ctx.run_dir, rank=self.ctx.dist.rank, keep_last=cfg.run.keep_last,
                                      resume_fallback=cfg.run.resume_fallback, log=self.ctx.print)
        # the checkpoint to resume is verified (every file's sha256) before any model or vLLM engine loads
        resume_from = self.ckpt.resolve(cfg.run.resume)
        self.parts = rl_build.build_parts(self.ctx, rollout=rollout, server_env=self.split.engine_env())
        self.ckpt.check_room(self.parts.engines_to_checkpoint())  # the first save fits, or stop now
        rl = cfg.rl
        self.kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target > 0
                       else FixedKLController(rl.kl_coef))
        self.evaluation = (RunEvaluation(self.ctx, self.parts.reward.fn, episode_scores=self.parts.reward.combined)
                           if rl_eval_on(cfg) else None)
        self.best = BestCheckpointTracker(cfg.eval.best_metric, cfg.eval.best_mode) if cfg.eval.best_metric else None
        self.sample_logger: SampleLogger | None = None  # opened by train(), beside the metrics logger
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.timer = PhaseTimer(sync_cuda=self.ctx.dist.device.type == "cuda")
        self.memory = None
        if cfg.run.profile_memory:  # --run.profile_memory: measured peak per phase vs the plan
            self.memory = MemoryProfiler(cfg, self.ctx.dist.device, self.ctx.dist.world_size, announce=self.ctx.print)
            self.timer.observer = self.memory
        self.service = rollout_service(self.parts, self.ctx, self.timer)
        if resume_from is not None:
            self._restore(resume_from)
        # Sync before the first rollout: after a resume the engine holds the weights on disk, not the restored ones,
        # and a shared engine may hold another run's weights. It also proves the sync path before any training.
        self.last_sync = self.service.start(self.step)

    # ---- state -------------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        state = {"loader": self.parts.loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                 "generator": self.generator.get_state(), "rollout": self.service.state_dict()}
        if self.best is not None:
            state["best"] = self.best.state_dict()
        if self.parts.curriculum is not None:
            state["curriculum"] = self.parts.curriculum.state_dict()
        return state

    def _restore(self, path) -> None:
        state = self.ckpt.load(path, self.parts.engines_to_checkpoint())
        self.step = int(state["step"])
        self.parts.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.generator.set_state(state["generator"])
        self.service.load_state_dict(state.get("rollout", {}))
        if self.best is not None and state.get("best") is not None:
            self.best.load_state_dict(state["best"])
        if self.parts.curriculum is not None and state.get("curriculum") is not None:
            self.parts.curriculum.load_state_dict(state["curriculum"])
        if self.ctx.dist.is_main:
            truncate_metrics(self.ctx.run_dir, self.step)
            truncate_samples(self.ctx.run_dir, self.step)
        self.ctx.print(f"[rl] resumed from {path} at step {self.step}")

    def _save(self) -> None:
        self.service.quiesce()  # the batch in flight collected (it is saved), every sync confirmed
        path = self.ckpt.save(self.step, self.parts.engines_to_checkpoint(), self._trainer_state())
        if self.best is not None and self.best.best_step == self.step and self.ctx.dist.is_main:
            info = {"step": self.step, "metric": self.best.metric_key, "mode": self.best.mode,
                    "value": self.best.best_value}
            best = keep_best(self.ctx.run_dir, path, info=info)
            self.ctx.print(f"[rl] best {self.best.metric_key} = {self.best.best_value:.4g} at step {self.step}: "
                           f"{best}")

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One RL step, stages 1-6 (the module docstring; docs/ARCHITECTURE.md's table). Returns the step's metrics
        averaged over ranks; writes the step's sample rows when the sample log is due."""
        t0 = time.perf_counter()
        cfg, ctx, parts, timer, step = self.cfg, self.ctx, self.parts, self.timer, self.step
        kl_coef = self.kl_ctl.value
        # 1 rollout: this step's prompt rows, generated with the weights of `batch.weights_version` (their sync
        #   confirmed); with async generation the next step's batch is submitted and generates while this one trains
        # 2b dynamic sampling: rounds of 1 and 2 hand over a ScoredBatch
        if cfg.rl.dynamic_sampling:
            scored = dynamic_batch(self.service, parts, ctx, timer, step)
        else:
            batch = self.service.batch(step)
            # 2 rewards (and shaping)
            with timer.phase("reward"):
                scored = parts.reward(batch, step=step)
            if parts.curriculum is not None:
                parts.curriculum.observe(scored)
        # 3 trajectory: padded rows, old / reference log-probs, values, advantages
        traj = make_trajectory(parts, ctx, scored, kl_coef=kl_coef, timer=timer)
        # 4 update: the policy (and critic) optimizer steps
        with timer.phase("train"):
            teacher = parts.reference if cfg.rl.distill_loss != "none" else None  # rl.teacher: the reference
            update = policy_update(parts.actor, parts.critic, traj, cfg, kl_coef=kl_coef, generator=self.generator,
                                   teacher=teacher)
        # 5 publish: the new weights to the rollout service (synced now, without waiting, or at the next idle point)
        self.service.publish(step + 1)
        report = self.service.take_report()  # this step's syncs and confirmations
        # 6 metrics: this rank's, then averaged over ranks; the KL controller moves; sample rows when due
        metrics = step_metrics(ctx, scored, traj, update, kl_coef)
        metrics.update(staleness_metrics(traj, step))  # rollout/staleness, _mean, _max
        metrics["rollout/groups"] = len(scored.rollout.rows)
        metrics.update(self.service.metrics())
        metrics.update(generation_metrics(scored.rollout))
        if parts.curriculum is not None:  # rl.curriculum: skipped, tracked, the pass-rate histogram
            metrics.update(parts.curriculum.metrics())
        if report is not None:
            self.last_sync = report
            metrics.update({f"sync/{k}": v for k, v in report.items() if isinstance(v, int | float)})
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(timer.pop())
        if self.memory is not None:
            metrics.update(self.memory.step_metrics())
        metrics["time/wall"] = time.perf_counter() - t0
        metrics["throughput/tokens_per_s"] = float(traj.seq_lens.sum()) / max(metrics["time/wall"], 1e-9)
        metrics["throughput/completions_per_s"] = metrics.get("rollout/samples", 0.0) / max(metrics["time/wall"], 1e-9)
        metrics = all_reduce_mean(metrics, ctx.dist.device)
        metrics.update(system_stats(ctx.dist.local_rank))
        update_kl_controller(self.kl_ctl, metrics, ctx.dist.world_size)
        rows = sample_rows(ctx, scored, traj, cfg.run.sample_log_k) if self.sample_logger is not None \
            and self.sample_logger.due(step + 1) else []
        if rows:
            self.sample_logger.maybe_log(step + 1, rows)
        return metrics

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out `eval/...` metrics of the weights after `self.step` updates (collective: every rank).

        The rollout engine must be idle: with `rollout.async_generation` the next step's batch is in flight here,
        so it is collected first and kept (`RolloutService.quiesce`, as before a checkpoint), with the later batches
        `rollout.max_staleness` still has the engine's older weights generate, and the service then returns them as
        it would have. `quiesce(self.step)` then syncs the engine to this step's weights; the staleness rule counts
        from the service's own last sync, so every later batch is generated with the same weights as without
        evaluation (with k = 1 this is the sync the next step would make; it then makes none).
        `rl_eval.evaluate` restores every RNG, so training and its resume are exactly as without evaluation.
        """
        # waits for the generation in flight (if any), checks the last sync, syncs the step's weights: idle after it
        self.last_sync = self.service.quiesce(self.step) or self.last_sync
        return self.evaluation.run(self.parts.rollout, generate=eval_generate(self.service))  # episodes: played

    def _eval_due(self) -> bool:
        every = self.cfg.run.eval_every
        return self.evaluation is not None and every > 0 and self.step % every == 0

    def _new_best(self, metrics: dict) -> bool:
        """Whether this step's evaluation is the best so far by `eval.best_metric` (then this step is saved)."""
        if self.best is None or not any(k.startswith("eval/") for k in metrics):
            return False
        if self.best.metric_key not in metrics and self.best.best_step is None:
            self.ctx.print(f"[rl] warning: eval.best_metric={self.best.metric_key!r} is not among the eval metrics "
                           f"({', '.join(sorted(k for k in metrics if k.startswith('eval/')))}): no best checkpoint")
        return self.best.update(self.step, metrics)

    # ---- loop --------------------------------------------------------------------------------------------
    def _loop_step(self, logger) -> dict:
        """One step of the loop: train, evaluate when due, log, then save on a signal, when due or on a new best."""
        cfg = self.cfg
        metrics = guard_step(self.train_step, step=self.step + 1, policy=cfg.rl.on_nonfinite, print_fn=self.ctx.print,
                             on_skip=self.timer.pop)  # a non-finite reward, loss or grad norm: stop, or skip the step
        self.step += 1
        if self._eval_due():
            metrics.update(self.evaluate())
        new_best = self._new_best(metrics)
        metrics = self.monitor.after_step(self.step, metrics)  # health warnings, live metrics
        logger.log(self.step, metrics)
        self.lifecycle.after_step()  # SIGTERM / SIGINT: keep the finished step, then exit 128 + sig
        due = cfg.run.save_every and self.step % cfg.run.save_every == 0
        saved = bool((due or new_best) and self.step < cfg.run.steps)  # the last step is saved by train()
        if saved:
            self._save()
        exported = rl_export.export_if_due(self.ctx, self.parts, self.step)  # run.export_every: HF dirs
        if saved or exported is not None:  # a signal that came during that save or export: stop now
            self.lifecycle.after_save(saved)
        return metrics

    def train(self) -> list[dict]:
        cfg, ctx = self.cfg, self.ctx
        before = cfg.run.eval_before_train and self.evaluation is not None and self.step == 0
        # the step-0 evaluation is logged like a step: start the progress bar one below so it ends at run.steps
        logger = ctx.metrics_logger(total_steps=cfg.run.steps, start_step=-1 if before else self.step,
                                    desc=f"rl[{cfg.rl.algo}]", postfix_keys=PROGRESS_KEYS)
        self.monitor.set_printer(logger.print)
        return self.lifecycle.run(lambda: self._train(logger, before), close=lambda: self._close(logger))

    def _train(self, logger, before: bool) -> list[dict]:
        """The loop, the final save and export (inside `RunLifecycle.run`, which stops it on a signal)."""
        cfg = self.cfg
        self.sample_logger = SampleLogger(self.ctx.run_dir, self.ctx.dist.rank, cfg.run.sample_log_every,
                                          cfg.run.sample_log_k, tensorboard_writer=logger.tensorboard_writer,
                                          wandb_run=logger.wandb_run)
        if before:  # the baseline: logged at step 0, not a candidate for the best checkpoint
            logger.log(0, self.evaluate())
        history = []
        while self.step < cfg.run.steps:
            history.append(self._loop_step(logger))
        self._save()
        if cfg.run.export_hf:
            rl_export.export(self.ctx, self.parts)
        return history

    def _close(self, logger) -> None:
        if self.sample_logger is not None:
            self.sample_logger.close()
        logger.close()
        if self.evaluation is not None:
            self.evaluation.close()
        self.parts.close()


# ---- the step's stages ---------------------------------------------------------------------------------
def make_trajectory(parts: RLParts, ctx: RunContext, scored: ScoredBatch, *, kl_coef: float,
                    timer: PhaseTimer) -> Trajectory:
    """Pad the kept samples, add the forward passes the settings need, then the advantages."""
    cfg = ctx.cfg
    traj = pad_trajectory(scored.samples, scored.scores, ctx.tokenizer.pad_token_id, device=ctx.dist.device,
                          weights_version=scored.rollout.weights_version, mask_truncated=cfg.rl.overlong_mask)
    with timer.phase("old_logp"):
        if not cfg.rl.single_update():  # several updates per rollout batch need the pre-update policy's log-probs
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
           "rollout/samples": len(traj), "kl/coef": kl_coef}
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
                    "weights_version": scored.rollout.weights_version if s.weights_version is None
                    else s.weights_version, "data_source": row.get("data_source"),
                    "sample_index": s.sample_index, "prompt_index": s.prompt_index,
                    "finish_reason": s.finish_reason})
        if s.episode is not None:  # a multi-turn episode: its turns, tool calls and truncation
            out[-1].update(episode_fields(s.response_ids, s.loss_mask, s.episode, ctx.tokenizer))
    return out



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
