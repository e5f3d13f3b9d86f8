"""The RL loop around `rl_step.run_step`: `run.steps` steps, checkpoints every `run.save_every` steps and at the end,
exact resume from `run.resume`, metrics averaged over ranks and logged; held-out evaluation (`rl_eval`) before
training and every `run.eval_every` steps, the best checkpoint by `rl.best_metric`, and a few samples every
`run.sample_log_every` steps. Building is `rl_build.py`; one step, stage by stage, is `rl_step.py`; the formulas
live in `ds_rlhf.algos`. The operator extras (environment.json, status.json, health warnings, the live metrics
endpoint) are `tools.run_monitor.RunMonitor`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ds_rlhf.algos.kl import AdaptiveKLController, FixedKLController
from ds_rlhf.config import Config, ConfigError
from ds_rlhf.distributed import all_reduce_mean
from ds_rlhf.rollout.factory import resolve_backend
from ds_rlhf.telemetry import PhaseTimer, system_stats
from ds_rlhf.telemetry.logger import truncate_metrics
from ds_rlhf.telemetry.samples import SampleLogger, truncate_samples
from ds_rlhf.tools.run_monitor import RunMonitor
from ds_rlhf.trainer import rl_build
from ds_rlhf.trainer.preflight import check_rl_run, rl_eval_on
from ds_rlhf.trainer.rl_eval import BestCheckpointTracker, RunEvaluation, keep_best
from ds_rlhf.trainer.rl_step import run_step, update_kl_controller
from ds_rlhf.trainer.rollout_schedule import RolloutSchedule, merge_reports
from ds_rlhf.trainer.run_checkpoints import CheckpointManager
from ds_rlhf.trainer.run_context import RunContext, setup_run
from ds_rlhf.trainer.signals import GracefulStop

PROGRESS_KEYS = ("reward/mean", "reward/exact_match", "actor/entropy", "mismatch/kl_rollout_trainer", "time/wall",
                 "eval/pass@1")


class TimedDraws:
    """The prompt loader's iterator with each draw charged to the timer's `data` phase. The rollout schedule draws
    inside its `rollout` phase; PhaseTimer charges nested phases exclusively, so the draw's seconds move from
    `time/rollout` to `time/data` and `time/step` still counts them once."""

    def __init__(self, it: Iterator[list[dict]], timer: PhaseTimer):
        self.it, self.timer = it, timer

    def __iter__(self) -> TimedDraws:
        return self

    def __next__(self) -> list[dict]:
        with self.timer.phase("data"):
            return next(self.it)


def check_rollout_precision(cfg: Config, ctx: RunContext) -> None:
    """vLLM on CPU syncs weights only in float32: refuse another precision before any model is built (vLLM would
    refuse it only after the actor is loaded and the engine has started)."""
    if ctx.dist.device.type == "cpu" and ctx.precision != "fp32" and resolve_backend(cfg.rollout.backend) == "vllm":
        raise ConfigError(f"model.dtype={cfg.model.dtype} ({ctx.precision}) with the vLLM rollout on CPU: vLLM's CPU "
                          "backend takes weight syncs only in float32; use --model.dtype fp32 (or auto), or "
                          "--rollout.backend hf")


class RLTrainer:
    def __init__(self, cfg: Config, rollout=None):
        self.cfg = cfg
        check_rl_run(cfg)  # inputs on disk, before any process group, engine or vLLM starts
        self.ctx: RunContext = setup_run(cfg, "rl")
        self.monitor = RunMonitor.for_run(self.ctx, "rl", cfg.run.steps)  # status.json says how a run ended
        try:
            self._build(rollout)
        except BaseException as exc:
            self.monitor.finish(exc, step=0)
            raise

    def _build(self, rollout) -> None:
        cfg = self.cfg
        if rollout is None:
            check_rollout_precision(cfg, self.ctx)
        self.ckpt = CheckpointManager(self.ctx.run_dir, rank=self.ctx.dist.rank, keep_last=cfg.run.keep_last,
                                      resume_fallback=cfg.run.resume_fallback, log=self.ctx.print)
        # the checkpoint to resume is verified (every file's sha256) before any model or vLLM engine loads
        resume_from = self.ckpt.resolve(cfg.run.resume)
        self.parts = rl_build.build_parts(self.ctx, rollout=rollout)
        rl = cfg.rl
        self.kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target > 0
                       else FixedKLController(rl.kl_coef))
        self.evaluation = RunEvaluation(self.ctx, self.parts.reward.fn) if rl_eval_on(cfg) else None
        self.best = BestCheckpointTracker(rl.best_metric, rl.best_mode) if rl.best_metric else None
        self.sample_logger: SampleLogger | None = None  # opened by train(), beside the metrics logger
        self.step = 0
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.timer = PhaseTimer(sync_cuda=self.ctx.dist.device.type == "cuda")
        self.memory = None
        if cfg.run.profile_memory:  # --run.profile_memory: measured peak per phase vs the plan
            from ds_rlhf.tools.memory_profile import MemoryProfiler

            self.memory = MemoryProfiler(cfg, self.ctx.dist.device, self.ctx.dist.world_size, announce=self.ctx.print)
            self.timer.observer = self.memory
        self.parts.loader_iter = TimedDraws(self.parts.loader_iter, self.timer)  # time/data
        self.schedule = RolloutSchedule(self.parts, self.ctx, self.timer, start_step=0)
        if resume_from is not None:
            self._restore(resume_from)
        # Sync before the first rollout: after a resume the engine holds the weights on disk, not the restored ones,
        # and a shared engine may hold another run's weights. It also proves the sync path before any training.
        self.last_sync = self.schedule.first_sync(self.step)

    # ---- state -------------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        state = {"loader": self.parts.loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                 "generator": self.generator.get_state(), "rollout": self.schedule.state_dict()}
        if self.best is not None:
            state["best"] = self.best.state_dict()
        return state

    def _restore(self, path) -> None:
        state = self.ckpt.load(path, self.parts.engines_to_checkpoint())
        self.step = int(state["step"])
        self.parts.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.generator.set_state(state["generator"])
        self.schedule = RolloutSchedule(self.parts, self.ctx, self.timer, start_step=self.step)
        self.schedule.load_state_dict(state.get("rollout", {}))
        if self.best is not None and state.get("best") is not None:
            self.best.load_state_dict(state["best"])
        if self.ctx.dist.is_main:
            truncate_metrics(self.ctx.run_dir, self.step)
            truncate_samples(self.ctx.run_dir, self.step)
        self.ctx.print(f"[rl] resumed from {path} at step {self.step}")

    def _save(self) -> None:
        path = self.ckpt.save(self.step, self.parts.engines_to_checkpoint(), self._trainer_state())
        if self.best is not None and self.best.best_step == self.step and self.ctx.dist.is_main:
            info = {"step": self.step, "metric": self.best.metric_key, "mode": self.best.mode,
                    "value": self.best.best_value}
            best = keep_best(self.ctx.run_dir, path, info=info)
            self.ctx.print(f"[rl] best {self.best.metric_key} = {self.best.best_value:.4g} at step {self.step}: "
                           f"{best}")

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step: its batch from the schedule, `rl_step.run_step`, the weight sync; metrics averaged over ranks,
        and the KL controller moved. Writes the step's sample rows when the sample log is due."""
        t0 = time.perf_counter()
        samples = self.sample_logger is not None and self.sample_logger.due(self.step + 1)
        batch, report = self.schedule.next_batch(self.step, self.cfg.run.steps)
        metrics, rows = run_step(self.parts, self.ctx, batch, step=self.step, kl_coef=self.kl_ctl.value,
                                 generator=self.generator, timer=self.timer,
                                 samples=self.cfg.run.sample_log_k if samples else 0)
        report = merge_reports(report, self.schedule.after_update(self.step + 1))
        if report is not None:
            self.last_sync = report
            metrics.update({f"sync/{k}": v for k, v in report.items() if isinstance(v, int | float)})
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(self.timer.pop())
        if self.memory is not None:
            metrics.update(self.memory.step_metrics())
        metrics["time/wall"] = time.perf_counter() - t0
        metrics["throughput/tokens_per_s"] = metrics.pop("_tokens", 0.0) / max(metrics["time/wall"], 1e-9)
        metrics["throughput/completions_per_s"] = metrics.get("rollout/samples", 0.0) / max(metrics["time/wall"], 1e-9)
        metrics = all_reduce_mean(metrics, self.ctx.dist.device)
        metrics.update(system_stats(self.ctx.dist.local_rank))
        update_kl_controller(self.kl_ctl, metrics, self.ctx.dist.world_size)
        if rows:
            self.sample_logger.maybe_log(self.step + 1, rows)
        return metrics

    # ---- evaluation --------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out `eval/...` metrics of the weights after `self.step` updates (collective: every rank).

        The rollout engine must be idle: with `rollout.async_generation` the next step's batch is in flight here,
        so it is collected first and kept as a finished ticket (`RolloutSchedule.state_dict` does exactly that, as
        a checkpoint needs it), and the schedule then trains on it as it would have. In async mode the engine
        also still holds the weights before the last update: it is synced now, which is the sync the schedule
        would make before its next submit anyway (`RLConfig` refuses evaluation with `rollout.max_staleness` > 1,
        where it would not), so every later batch is generated with the same weights as without evaluation; its
        time is the next step's `time/sync`. `rl_eval.evaluate` restores every RNG, so training and its resume
        are exactly as without evaluation.
        """
        self.schedule.settle()  # waits for the generation in flight (if any) and checks the last sync: idle after it
        if self.schedule.engine_version != self.step:
            self.last_sync = self.schedule.sync(self.step)
        return self.evaluation.run(self.parts.rollout)

    def _eval_due(self) -> bool:
        every = self.cfg.run.eval_every
        return self.evaluation is not None and every > 0 and self.step % every == 0

    def _new_best(self, metrics: dict) -> bool:
        """Whether this step's evaluation is the best so far by `rl.best_metric` (then this step is saved)."""
        if self.best is None or not any(k.startswith("eval/") for k in metrics):
            return False
        if self.best.metric_key not in metrics and self.best.best_step is None:
            self.ctx.print(f"[rl] warning: rl.best_metric={self.best.metric_key!r} is not among the eval metrics "
                           f"({', '.join(sorted(k for k in metrics if k.startswith('eval/')))}): no best checkpoint")
        return self.best.update(self.step, metrics)

    # ---- loop --------------------------------------------------------------------------------------------
    def _loop_step(self, logger, stop) -> dict:
        """One step of the loop: train, evaluate when due, log, then save on a signal, when due or on a new best."""
        cfg = self.cfg
        metrics = self.train_step()
        self.step += 1
        if self._eval_due():
            metrics.update(self.evaluate())
        new_best = self._new_best(metrics)
        metrics = self.monitor.after_step(self.step, metrics)  # health warnings, live metrics
        logger.log(self.step, metrics)
        if signum := stop.pending():  # SIGTERM / SIGINT: keep the finished step, then exit 128 + sig
            self._save()
            stop.exit(signum, announce=self.ctx.print)
        due = cfg.run.save_every and self.step % cfg.run.save_every == 0
        saved = bool((due or new_best) and self.step < cfg.run.steps)  # the last step is saved by train()
        if saved:
            self._save()
        exported = rl_build.export_if_due(self.ctx, self.parts, self.step)  # run.export_every: HF dirs
        # a signal that came during that save or export: stop now, not after the next step
        if (saved or exported is not None) and (signum := stop.pending()):
            if not saved:
                self._save()
            stop.exit(signum, announce=self.ctx.print)
        return metrics

    def train(self) -> list[dict]:
        cfg, ctx = self.cfg, self.ctx
        before = cfg.run.eval_before_train and self.evaluation is not None and self.step == 0
        # the step-0 evaluation is logged like a step: start the progress bar one below so it ends at run.steps
        logger = ctx.metrics_logger(total_steps=cfg.run.steps, start_step=-1 if before else self.step,
                                    desc=f"rl[{cfg.rl.algo}]", postfix_keys=PROGRESS_KEYS)
        self.monitor.set_printer(logger.print)
        history = []
        error: BaseException | None = None
        # the handlers cover the whole run, the final save, export and shut-down included: a signal after the last
        # step waits for the final checkpoint, then the run exits 128 + signal like one stopped mid-run
        with GracefulStop(ctx.dist.device, announce=ctx.print) as stop:
            try:
                self.sample_logger = SampleLogger(ctx.run_dir, ctx.dist.rank, cfg.run.sample_log_every,
                                                  cfg.run.sample_log_k, tensorboard_writer=logger.tensorboard_writer,
                                                  wandb_run=logger.wandb_run)
                if before:  # the baseline: logged at step 0, not a candidate for the best checkpoint
                    logger.log(0, self.evaluate())
                while self.step < cfg.run.steps:
                    history.append(self._loop_step(logger, stop))
                self._save()
                if cfg.run.export_hf:
                    rl_build.export(self.ctx, self.parts)
                if stop.signum:  # it came during the final save or export, which are done: status.json says stopped
                    stop.exit(stop.signum, announce=ctx.print)
            except BaseException as exc:
                error = exc
                raise
            finally:
                try:
                    if self.sample_logger is not None:
                        self.sample_logger.close()
                    logger.close()
                    if self.evaluation is not None:
                        self.evaluation.close()
                    self.parts.close()
                finally:
                    self.monitor.finish(error, step=self.step)  # status.json, before the lock is released
                    ctx.close()  # releases the run directory's lock
            if stop.signum:  # it came during the shut-down, after the final checkpoint was saved
                stop.exit(stop.signum, announce=ctx.print)
        return history
