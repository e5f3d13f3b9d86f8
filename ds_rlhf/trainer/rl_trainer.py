"""The RL loop: prompts -> rollout -> rewards -> reference/values -> advantages -> PPO update -> weight sync.

One `RLTrainer.train()` call runs `run.steps` steps, checkpointing every `run.save_every` steps and at the end, and
resuming exactly from `run.resume`. Everything algorithmic lives in `ds_rlhf.algos`; this file orchestrates.
"""

from __future__ import annotations

import time

import torch

from ds_rlhf.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty
from ds_rlhf.algos.mismatch import mismatch_metrics
from ds_rlhf.config import Config
from ds_rlhf.distributed import all_reduce_mean
from ds_rlhf.telemetry import PhaseTimer, system_stats
from ds_rlhf.trainer import rl_setup
from ds_rlhf.trainer.experience import build_experience
from ds_rlhf.trainer.rl_math import compute_advantages
from ds_rlhf.trainer.rl_update import ppo_update, score_logprobs, score_values
from ds_rlhf.trainer.run_checkpoints import CheckpointManager
from ds_rlhf.trainer.run_context import RunContext, setup_run

PROGRESS_KEYS = ("reward/mean", "reward/exact_match", "actor/entropy", "mismatch/kl_rollout_trainer", "time/wall")


class RLTrainer:
    def __init__(self, cfg: Config, rollout=None):
        self.cfg = cfg
        self.ctx: RunContext = setup_run(cfg, "rl")
        self.parts = rl_setup.build_parts(self.ctx, rollout=rollout)
        rl = cfg.rl
        self.kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target > 0
                       else FixedKLController(rl.kl_coef))
        self.ckpt = CheckpointManager(self.ctx.run_dir, rank=self.ctx.dist.rank, keep_last=cfg.run.keep_last)
        self.step = 0
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        self.timer = PhaseTimer(sync_cuda=self.ctx.dist.device.type == "cuda")
        resume_from = self.ckpt.resolve(cfg.run.resume)
        if resume_from is not None:
            self._restore(resume_from)
        # Sync before the first rollout: after a resume the engine holds the weights on disk, not the restored ones,
        # and a shared engine may hold another run's weights. It also proves the sync path before any training.
        with self.timer.phase("sync"):
            self.last_sync = self.parts.sync.sync()

    # ---- state -------------------------------------------------------------------------------------------
    def _engines(self) -> dict:
        engines = {"actor": self.parts.actor}
        if self.parts.critic is not None:
            engines["critic"] = self.parts.critic
        return engines

    def _trainer_state(self) -> dict:
        return {"loader": self.parts.loader.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "generator": self.generator.get_state()}

    def _restore(self, path) -> None:
        state = self.ckpt.load(path, self._engines())
        self.step = int(state["step"])
        self.parts.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.generator.set_state(state["generator"])
        rl_setup.truncate_metrics(self.ctx, self.step)
        self.ctx.print(f"[rl] resumed from {path} at step {self.step}")

    # ---- one step ----------------------------------------------------------------------------------------
    def _rollout(self, rows: list[dict]):
        cfg, parts = self.cfg, self.parts
        spec = rl_setup.sampling_spec(self.ctx, self.step)
        parts.rollout.wake()
        samples = parts.rollout.generate([list(r["input_ids"]) for r in rows], spec)
        if self.ctx.dist.device.type == "cuda" and cfg.rollout.sleep:
            parts.rollout.sleep()
        return samples

    def train_step(self) -> dict:
        cfg, parts, ctx, timer = self.cfg, self.parts, self.ctx, self.timer
        rows = next(parts.loader_iter)
        with timer.phase("rollout"):
            samples = self._rollout(rows)
        with timer.phase("reward"):
            samples, scores, reward_metrics = parts.reward(samples, rows, step=self.step)
        exp = build_experience(samples, scores, ctx.tokenizer.pad_token_id, device=ctx.dist.device)
        kl_coef = self.kl_ctl.value
        # One update per rollout batch: the log-probs of that update's own forward are the old policy's. Decided
        # from settings only, never from this rank's sample count, so every rank takes the same (collective) path.
        on_policy = cfg.rl.ppo_epochs == 1 and cfg.rl.mini_batch_size == 0
        with timer.phase("old_logp"):
            if not on_policy:  # several updates per rollout batch need the pre-update policy's log-probs
                exp.old_logp = score_logprobs(parts.actor, exp, cfg)
        with timer.phase("reference"):
            if parts.reference is not None:
                exp.ref_logp = score_logprobs(parts.reference, exp, cfg)
        with timer.phase("critic"):
            if parts.critic is not None:
                exp.values = score_values(parts.critic, exp, cfg)
        compute_advantages(exp, cfg.rl, kl_coef)
        with timer.phase("train"):
            update = ppo_update(parts.actor, parts.critic, exp, cfg, kl_coef=kl_coef, generator=self.generator)
        with timer.phase("sync"):
            self.last_sync = parts.sync.sync()
        metrics = {**reward_metrics, **update, **self._rollout_metrics(exp), **self._kl_metrics(exp, kl_coef)}
        metrics["_tokens"] = float(exp.seq_lens.sum())
        return metrics

    def _rollout_metrics(self, exp) -> dict:
        lens = exp.response_lens.float()
        trainer_logp = exp.old_logp if exp.old_logp is not None else exp.extras["trainer_logp"]
        out = {"response/len_mean": lens.mean(), "response/len_max": lens.max(),
               "response/truncated_frac": (exp.response_lens >= self.cfg.rollout.max_new_tokens).float().mean(),
               "rollout/samples": len(exp)}
        out.update(mismatch_metrics(trainer_logp, exp.rollout_logp, exp.action_mask))
        return out

    def _kl_metrics(self, exp, kl_coef: float) -> dict:
        if exp.ref_logp is None:
            return {"kl/coef": kl_coef}
        mask = exp.action_mask
        kl = (kl_penalty(exp.old_logp_or_rollout(), exp.ref_logp, "k1") * mask).sum() / mask.sum().clamp(min=1)
        return {"kl/coef": kl_coef, "kl/mean": kl}

    # ---- loop --------------------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg, ctx = self.cfg, self.ctx
        logger = ctx.metrics_logger(total_steps=cfg.run.steps, start_step=self.step, desc=f"rl[{cfg.rl.algo}]",
                                    postfix_keys=PROGRESS_KEYS)
        history = []
        try:
            while self.step < cfg.run.steps:
                t0 = time.perf_counter()
                metrics = self.train_step()
                self.step += 1
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics.update(self.timer.pop())
                metrics.update({f"sync/{k}": v for k, v in self.last_sync.items() if isinstance(v, int | float)})
                metrics["time/wall"] = time.perf_counter() - t0
                metrics["throughput/tokens_per_s"] = metrics.pop("_tokens", 0.0) / max(metrics["time/wall"], 1e-9)
                metrics = all_reduce_mean(metrics, ctx.dist.device)
                metrics.update(system_stats(ctx.dist.local_rank))
                self.kl_ctl.update(metrics.get("kl/mean", 0.0), n_steps=1)
                logger.log(self.step, metrics)
                history.append(metrics)
                if cfg.run.save_every and self.step % cfg.run.save_every == 0 and self.step < cfg.run.steps:
                    self.ckpt.save(self.step, self._engines(), self._trainer_state())
            self.ckpt.save(self.step, self._engines(), self._trainer_state())
            if cfg.run.export_hf:
                rl_setup.export(self.ctx, self.parts)
        finally:
            logger.close()
            self.parts.close()
        return history
