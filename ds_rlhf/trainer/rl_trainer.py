"""The RL loop around `rl_step.run_step`: `run.steps` steps, checkpoints every `run.save_every` steps and at the end,
exact resume from `run.resume`, metrics averaged over ranks and logged. Building is `rl_build.py`; one step,
stage by stage, is `rl_step.py`; the formulas live in `ds_rlhf.algos`.
"""

from __future__ import annotations

import time

import torch

from ds_rlhf.algos.kl import AdaptiveKLController, FixedKLController
from ds_rlhf.config import Config
from ds_rlhf.distributed import all_reduce_mean
from ds_rlhf.telemetry import PhaseTimer, system_stats
from ds_rlhf.telemetry.logger import truncate_metrics
from ds_rlhf.trainer import rl_build
from ds_rlhf.trainer.preflight import check_rl_run
from ds_rlhf.trainer.rl_step import run_step, update_kl_controller
from ds_rlhf.trainer.rollout_schedule import RolloutSchedule
from ds_rlhf.trainer.run_checkpoints import CheckpointManager
from ds_rlhf.trainer.run_context import RunContext, setup_run
from ds_rlhf.trainer.signals import GracefulStop

PROGRESS_KEYS = ("reward/mean", "reward/exact_match", "actor/entropy", "mismatch/kl_rollout_trainer", "time/wall")


class RLTrainer:
    def __init__(self, cfg: Config, rollout=None):
        self.cfg = cfg
        check_rl_run(cfg)  # inputs on disk, before any process group, engine or vLLM starts
        self.ctx: RunContext = setup_run(cfg, "rl")
        self.parts = rl_build.build_parts(self.ctx, rollout=rollout)
        rl = cfg.rl
        self.kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target > 0
                       else FixedKLController(rl.kl_coef))
        self.ckpt = CheckpointManager(self.ctx.run_dir, rank=self.ctx.dist.rank, keep_last=cfg.run.keep_last,
                                      resume_fallback=cfg.run.resume_fallback, log=self.ctx.print)
        self.step = 0
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.timer = PhaseTimer(sync_cuda=self.ctx.dist.device.type == "cuda")
        self.schedule = RolloutSchedule(self.parts, self.ctx, self.timer, start_step=0)
        resume_from = self.ckpt.resolve(cfg.run.resume)
        if resume_from is not None:
            self._restore(resume_from)
        # Sync before the first rollout: after a resume the engine holds the weights on disk, not the restored ones,
        # and a shared engine may hold another run's weights. It also proves the sync path before any training.
        self.last_sync = self.schedule.sync(self.step)

    # ---- state -------------------------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {"loader": self.parts.loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "generator": self.generator.get_state(), "rollout": self.schedule.state_dict()}

    def _restore(self, path) -> None:
        state = self.ckpt.load(path, self.parts.engines_to_checkpoint())
        self.step = int(state["step"])
        self.parts.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.generator.set_state(state["generator"])
        self.schedule = RolloutSchedule(self.parts, self.ctx, self.timer, start_step=self.step)
        self.schedule.load_state_dict(state.get("rollout", {}))
        if self.ctx.dist.is_main:
            truncate_metrics(self.ctx.run_dir, self.step)
        self.ctx.print(f"[rl] resumed from {path} at step {self.step}")

    def _save(self) -> None:
        self.ckpt.save(self.step, self.parts.engines_to_checkpoint(), self._trainer_state())

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step: its batch from the schedule, `rl_step.run_step`, the weight sync; metrics averaged over ranks,
        and the KL controller moved."""
        t0 = time.perf_counter()
        batch, report = self.schedule.next_batch(self.step, self.cfg.run.steps)
        metrics = run_step(self.parts, self.ctx, batch, step=self.step, kl_coef=self.kl_ctl.value,
                           generator=self.generator, timer=self.timer)
        report = self.schedule.after_update(self.step + 1) or report
        if report is not None:
            self.last_sync = report
            metrics.update({f"sync/{k}": v for k, v in report.items() if isinstance(v, int | float)})
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(self.timer.pop())
        metrics["time/wall"] = time.perf_counter() - t0
        metrics["throughput/tokens_per_s"] = metrics.pop("_tokens", 0.0) / max(metrics["time/wall"], 1e-9)
        metrics = all_reduce_mean(metrics, self.ctx.dist.device)
        metrics.update(system_stats(self.ctx.dist.local_rank))
        update_kl_controller(self.kl_ctl, metrics, self.ctx.dist.world_size)
        return metrics

    # ---- loop --------------------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg, ctx = self.cfg, self.ctx
        logger = ctx.metrics_logger(total_steps=cfg.run.steps, start_step=self.step, desc=f"rl[{cfg.rl.algo}]",
                                    postfix_keys=PROGRESS_KEYS)
        history = []
        try:
            with GracefulStop(ctx.dist.device, announce=ctx.print) as stop:
                while self.step < cfg.run.steps:
                    metrics = self.train_step()
                    self.step += 1
                    logger.log(self.step, metrics)
                    history.append(metrics)
                    if signum := stop.pending():  # SIGTERM / SIGINT: keep the finished step, then exit 128 + sig
                        self._save()
                        stop.exit(signum, announce=ctx.print)
                    if cfg.run.save_every and self.step % cfg.run.save_every == 0 and self.step < cfg.run.steps:
                        self._save()
            self._save()
            if cfg.run.export_hf:
                rl_build.export(self.ctx, self.parts)
        finally:
            logger.close()
            self.parts.close()
            ctx.close()  # releases the run directory's lock
        return history
