"""The loop SFT, reward-model and DPO training share: batches from a store, micro-batches, eval, checkpoints, export.

A task (`SFTTask`, `RewardModelTask`, `DPOTask`) says how to build its engine and what a micro-batch's loss is
(and, optionally, `prepare`: one pass over its rows before training); everything else — launch, config,
resume, telemetry, progress bar — is this one implementation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ds_rlhf.config import Config
from ds_rlhf.data.loader import StoreLoader
from ds_rlhf.data.store import open_store
from ds_rlhf.distributed import all_reduce_mean
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory import cap as memory_cap
from ds_rlhf.run.checkpoint.manager import CheckpointManager
from ds_rlhf.run.context import RunContext, setup_run
from ds_rlhf.run.lifecycle import RunLifecycle
from ds_rlhf.run.preflight import check_supervised_run
from ds_rlhf.telemetry import PhaseTimer, system_stats
from ds_rlhf.telemetry.logger import truncate_metrics


class SupervisedTask(Protocol):
    name: str  # "sft" | "rm" | "dpo"
    store_kind: str  # the data store kind it reads
    progress_keys: tuple[str, ...]

    def build(self, ctx: RunContext, ds_config: dict): ...
    def micro_batches(self, ctx: RunContext, rows: list[dict]) -> list[list[dict]]: ...
    def count(self, rows: list[dict]) -> float: ...
    def loss_terms(self, engine, ctx: RunContext, rows: list[dict]) -> tuple[torch.Tensor, dict]: ...
    def evaluate(self, engine, ctx: RunContext, rows: list[dict]) -> dict: ...
    def export(self, engine, ctx: RunContext, out_dir: Path) -> None: ...


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/eval split of row indices (same seed -> same split on every rank and resume)."""
    if eval_fraction <= 0:
        return list(range(n)), []
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17)).tolist()
    n_eval = max(1, int(round(n * eval_fraction)))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def longest_sequence(store) -> np.ndarray:
    """Per row of `store`, its longest sequence in tokens (an SFT row's `input_ids`; the longer of a preference
    pair's chosen and rejected sequences), from the store's lengths file."""
    return np.max(np.stack([store.column_lengths(c) for c in store.manifest["length_columns"]], axis=1), axis=1)


def drop_long(indices, longest: np.ndarray, max_len: int) -> list[int]:
    """The rows of `indices` whose sequences all fit `max_len` tokens (`longest`: `longest_sequence`)."""
    return [i for i in indices if longest[i] <= max_len]


class SupervisedTrainer:
    def __init__(self, cfg: Config, task: SupervisedTask):
        self.cfg, self.task = cfg, task
        check_supervised_run(cfg, task.store_kind, task.name)  # inputs on disk, before any process group or model
        self.ctx = setup_run(cfg, task.name)
        self.step = 0
        self.lifecycle = RunLifecycle(self.ctx, task.name, cfg.run.steps, save=self._save, step=lambda: self.step)
        self.monitor = self.lifecycle.monitor  # status.json, health warnings, live metrics
        self.lifecycle.build(self._build)

    def _build(self) -> None:
        cfg, task, ctx = self.cfg, self.task, self.ctx
        self.ckpt = CheckpointManager(ctx.run_dir, rank=ctx.dist.rank, keep_last=cfg.run.keep_last,
                                      resume_fallback=cfg.run.resume_fallback, log=ctx.print)
        # the checkpoint to resume is verified (every file's sha256) before the model loads
        resume_from = self.ckpt.resolve(cfg.run.resume)
        # run.max_gpu_memory_gb: this process's allocator cap
        memory_cap.apply_trainer_cap(cfg, ctx.dist.device, "colocated")
        store = open_store(cfg.data.train, tokenizer=ctx.tokenizer, expect_kind=task.store_kind)
        train_idx, eval_idx = split_indices(len(store), 0.0 if cfg.data.eval else cfg.data.eval_fraction,
                                            cfg.run.seed)
        # data.max_len: rows with a sequence longer than it are dropped (as data prep's default --drop does),
        # counted in one line here and in the data/dropped_long metric
        longest = longest_sequence(store)
        kept = drop_long(train_idx, longest, cfg.data.max_len)
        dropped = {"data.train": len(train_idx) - len(kept)}
        if not kept:
            raise ConfigError(f"data.max_len={cfg.data.max_len}: every training row of data.train={cfg.data.train!r}"
                              f" is longer (the shortest has {int(longest[train_idx].min())} tokens); raise "
                              "--data.max_len (up to the model's context) or re-run data prep with a lower --max_len")
        train_idx = kept
        if cfg.data.eval:
            eval_store = open_store(cfg.data.eval, tokenizer=ctx.tokenizer, expect_kind=task.store_kind)
            eval_idx = drop_long(range(len(eval_store)), longest_sequence(eval_store), cfg.data.max_len)
            dropped["data.eval"] = len(eval_store) - len(eval_idx)
            self.eval_rows = [eval_store.row(i) for i in eval_idx]
        else:
            kept = drop_long(eval_idx, longest, cfg.data.max_len)
            dropped["eval split"] = len(eval_idx) - len(kept)
            self.eval_rows = [store.row(i) for i in kept]
        self.dropped_long = sum(dropped.values())
        if self.dropped_long:
            ctx.print(f"[{task.name}] data.max_len={cfg.data.max_len}: dropped {self.dropped_long} row(s) longer "
                      "than it (" + ", ".join(f"{n} of {k}" for k, n in dropped.items() if n) + ")")
        self.eval_rows = self.eval_rows[ctx.dist.rank :: ctx.dist.world_size]
        batch = cfg.optim.batch_size
        self.loader = StoreLoader(store, batch_size=batch, rank=ctx.dist.rank, world_size=ctx.dist.world_size,
                                  seed=cfg.run.seed, shuffle=cfg.data.shuffle, reader=cfg.data.reader,
                                  indices=train_idx)
        per_epoch = max(1, len(train_idx) // (batch * ctx.dist.world_size))
        self.total_steps = cfg.run.steps or per_epoch * cfg.run.epochs
        self.monitor.total_steps = self.total_steps
        ds_config = ctx.ds_config(role=task.name, micro_batch_size=max(1, cfg.optim.micro_batch_size),
                                  lr=cfg.optim.lr, total_steps=self.total_steps)
        self.engine = task.build(ctx, ds_config)
        self.ckpt.check_room({task.name: self.engine})  # the first save fits, or stop before training
        self.timer = PhaseTimer(sync_cuda=ctx.dist.device.type == "cuda")
        if resume_from is not None:
            state = self.ckpt.load(resume_from, {task.name: self.engine})
            self.step = int(state["step"])
            self.loader.load_state_dict(state["loader"])
            if ctx.dist.is_main:
                truncate_metrics(ctx.run_dir, self.step)
            ctx.print(f"[{task.name}] resumed from {resume_from} at step {self.step}")
        prepare = getattr(task, "prepare", None)  # a task's one-off pass over its rows before training (DPO)
        if prepare is not None:
            prepare(self.engine, ctx, store, train_idx, self.eval_rows)
        self.loader_iter = iter(self.loader)

    def train_step(self) -> dict:
        """One optimizer step: each micro-batch's summed loss divided by the step's total count (tokens or
        pairs), so any micro-batching gives the same gradient as one big batch."""
        with self.timer.phase("data"):
            rows = next(self.loader_iter)
        micro = self.task.micro_batches(self.ctx, rows)
        total = sum(self.task.count(mb) for mb in micro) or 1.0
        self.engine.train()
        metrics: dict[str, float] = {}
        with self.timer.phase("train"):
            for mb in micro:
                # an empty micro-batch (to match other ranks' count) runs one row with zero weight
                loss_sum, m = self.task.loss_terms(self.engine, self.ctx, mb or rows[:1])
                share = self.task.count(mb) / total if mb else 0.0
                self.engine.backward(loss_sum / total if mb else loss_sum * 0.0, scale_wrt_gas=False)
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) * share
            self.engine.step()
        metrics["train/lr"] = self.engine.get_lr()[0]
        metrics["data/dropped_long"] = float(self.dropped_long)  # rows data.max_len removed (train + eval)
        return metrics

    def evaluate(self) -> dict:
        if not self.eval_rows:
            return {}
        self.engine.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(self.engine, self.ctx, self.eval_rows)
        return all_reduce_mean(metrics, self.ctx.dist.device)

    def _save(self) -> None:
        self.ckpt.save(self.step, {self.task.name: self.engine}, {"loader": self.loader.state_dict()})

    def _logged_step(self, logger) -> None:
        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        metrics = self.train_step()
        self.step += 1
        metrics.update(self.timer.pop())
        metrics["time/wall"] = time.perf_counter() - t0
        metrics = all_reduce_mean(metrics, ctx.dist.device)
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0:
            metrics.update(self.evaluate())
        metrics.update(system_stats(ctx.dist.local_rank))
        metrics = self.monitor.after_step(self.step, metrics)  # health warnings, live metrics
        logger.log(self.step, metrics)

    def train(self) -> dict:
        ctx, task = self.ctx, self.task
        logger = ctx.metrics_logger(total_steps=self.total_steps, start_step=self.step, desc=task.name,
                                    postfix_keys=task.progress_keys)
        self.monitor.set_printer(logger.print)
        return self.lifecycle.run(lambda: self._train(logger), close=logger.close)

    def _train(self, logger) -> dict:
        """The loop, the final evaluation, save and export (inside `RunLifecycle.run`, which stops it on a signal)."""
        cfg, ctx, task, lifecycle = self.cfg, self.ctx, self.task, self.lifecycle
        summary = {"eval_before": self.evaluate()} if self.step == 0 else {}
        while self.step < self.total_steps:
            self._logged_step(logger)
            lifecycle.after_step()  # SIGTERM / SIGINT: keep the finished step, then exit 128 + sig
            if cfg.run.save_every and self.step % cfg.run.save_every == 0 and self.step < self.total_steps:
                self._save()
                lifecycle.after_save(saved=True)  # a signal during that save: stop now, not a step later
        summary["eval_after"] = self.evaluate()
        logger.log(self.step, {f"final/{k}": v for k, v in summary["eval_after"].items()})
        self._save()
        if cfg.run.export_hf:
            out = Path(ctx.run_dir) / "export"
            task.export(self.engine, ctx, out)
            summary["export"] = str(out)
            ctx.print(f"[{task.name}] exported to {out}")
        return summary
