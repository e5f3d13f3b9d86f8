"""Set-up shared by the SFT, RM and RL entry points: process group, run directory, tokenizer, ds_config.

`setup_run` takes the run directory's lock (rank 0, before anything is written) and applies the fresh-run /
resume / overwrite rules of `ds_rlhf.run.run_dir`; a refusal is raised on every rank with the same message.
`RunContext.close()` releases the lock (process exit does too, however the process ends).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ds_rlhf.config import Config
from ds_rlhf.config_rules import fp8_mismatch_note
from ds_rlhf.distributed import DistInfo, init_distributed
from ds_rlhf.ds_config_file import find_ds_config, load_ds_config
from ds_rlhf.engines.ds_config import OVERRIDES, pick_precision, resolve_ds_config
from ds_rlhf.engines.model_source import resolve_model_path, resolve_model_source
from ds_rlhf.errors import ConfigError
from ds_rlhf.redaction import redacted
from ds_rlhf.run.determinism import configure_determinism
from ds_rlhf.run.run_dir import RunDirError, RunLock, acquire_run_lock, broadcast_from_main, prepare_run_dir
from ds_rlhf.telemetry import MetricsLogger


def load_run_tokenizer(cfg: Config, model_path: str):
    """The run's tokenizer: `model.tokenizer` (a local directory or a Hub id) or the resolved model directory;
    the pad token falls back to the EOS token."""
    from transformers import AutoTokenizer

    source = resolve_model_source(cfg.model.tokenizer, "model.tokenizer", "tokenizer") if cfg.model.tokenizer \
        else model_path
    key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # a corrupt tokenizer.json is a JSONDecodeError
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}={getattr(cfg.model, key.split('.')[1])!r}: the tokenizer in {source} cannot be "
                          f"loaded ({type(exc).__name__}: {detail}); check its tokenizer.json / tokenizer_config.json"
                          ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class RunContext:
    cfg: Config
    dist: DistInfo
    run_dir: Path
    model_path: str
    tokenizer: object
    precision: str
    lock: RunLock | None = field(default=None, repr=False)

    @property
    def rollout_precision(self) -> str:
        """The rollout engines' precision: rollout.dtype, auto = the trainer's `precision`
        (`RolloutConfig.engine_precision`)."""
        return self.cfg.rollout.engine_precision(self.precision)

    def print(self, text: str) -> None:
        """A line on stdout (rank 0), above the progress bar when one is drawn (`tqdm.write`)."""
        if self.dist.is_main:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        """Release the run directory (idempotent); call when the run is over."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> RunContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics_logger(self, *, total_steps: int, start_step: int, desc: str, postfix_keys: tuple[str, ...]):
        """The run's MetricsLogger, configured from the `run` section (one place for SFT, RM and RL)."""
        run = self.cfg.run
        return MetricsLogger(self.run_dir, rank=self.dist.rank, total_steps=total_steps, start_step=start_step,
                             tensorboard=run.tensorboard, wandb=run.wandb, wandb_project=run.wandb_project,
                             config=redacted(self.cfg.to_dict()), progress=run.progress, desc=desc,
                             postfix_keys=postfix_keys, log_every=run.log_every)

    def ds_config(self, *, role: str, micro_batch_size: int, lr: float, total_steps: int,
                  frozen: bool = False) -> dict:
        """Resolve the run's ds_config for one role, save it beside the run, and return it."""
        cfg = self.cfg
        raw = load_ds_config(find_ds_config(cfg.ds_config))
        resolved = resolve_ds_config(
            raw, micro_batch_size=micro_batch_size, grad_accum=1, world_size=self.dist.world_size,
            precision=self.precision, grad_clip=cfg.optim.grad_clip, lr=lr, weight_decay=cfg.optim.weight_decay,
            betas=cfg.optim.betas, eps=cfg.optim.eps, warmup_steps=cfg.optim.warmup_steps, total_steps=total_steps,
            zero_stage=None if cfg.zero_stage < 0 else cfg.zero_stage, offload=cfg.offload or None)
        if not frozen:
            # RL and packed SFT have a variable number of micro-batches per optimizer step: we scale each
            # micro-batch's loss ourselves and call step() at the boundary (DeepSpeed's unmanaged mode).
            resolved["managed_gradient_accumulation"] = False
        zero = resolved.get("zero_optimization", {})
        # DeepSpeed's unmanaged mode overlaps the gradient reduction only where gradients are partitioned (ZeRO-2/3):
        # at ZeRO-0/1 (e.g. --zero_stage 1 over the default zero2.json) overlap_comm is turned off
        overlap_off = not frozen and zero.get("stage", 0) < 2 and zero.get("overlap_comm") is True
        if overlap_off:
            zero["overlap_comm"] = False
        if self.dist.is_main:
            if overlap_off:
                print(f"[ds_config] {role}: zero_optimization.overlap_comm=true from {cfg.ds_config} is turned off at "
                      f"ZeRO stage {zero['stage']} (DeepSpeed overlaps the gradient reduction at stage 2 and 3 only)",
                      flush=True)
            (self.run_dir / f"ds_config.{role}.json").write_text(json.dumps(resolved, indent=2, sort_keys=True))
            for key, in_file, in_run in OVERRIDES:  # the one precedence rule, said where the user sees it
                print(f"[ds_config] {role}: {key}={in_file!r} from {cfg.ds_config} overrides the run's {in_run!r} "
                      "(explicit values in the ds_config win; set them to \"auto\" to take the run's settings)",
                      flush=True)
        return resolved


def setup_run(cfg: Config, kind: str) -> RunContext:
    configure_determinism(cfg)  # run.deterministic: before CUDA, the process group and vLLM start
    dist = init_distributed(cfg)
    seed_everything(cfg.run.seed)
    run_dir = Path(cfg.run.output_dir)
    lock = claim_run_dir(cfg, dist, kind)
    try:
        model_path = resolve_model_path(cfg.model.path)
        tokenizer = load_run_tokenizer(cfg, model_path)
        precision = pick_precision(cfg.model.dtype)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    ctx = RunContext(cfg=cfg, dist=dist, run_dir=run_dir, model_path=model_path, tokenizer=tokenizer,
                     precision=precision, lock=lock)
    if dist.is_main:
        cfg.save(run_dir / "config.json")
        ctx.print(f"[{kind}] run dir {run_dir} | world size {dist.world_size} | device {dist.device.type} | "
                  f"precision {precision}{_rollout_note(cfg, precision)} | model {model_path}"
                  + (f" ({cfg.model.path})" if model_path != cfg.model.path else ""))
        ctx.print(f"[{kind}] resolved config: {run_dir / 'config.json'}")
        if kind == "rl" and (fp8_note := fp8_mismatch_note(cfg)):
            ctx.print(fp8_note)
    return ctx


def _rollout_note(cfg: Config, precision: str) -> str:
    """The run line's note on the rollout engines' precision where rollout.dtype sets one apart from the trainer's
    ("" otherwise)."""
    engine = cfg.rollout.engine_precision(precision)
    return f", rollout engines {engine} (rollout.dtype)" if engine != precision else ""


def claim_run_dir(cfg: Config, dist: DistInfo, kind: str = "run") -> RunLock | None:
    """Rank 0 locks the run directory and checks it (see `ds_rlhf.run.run_dir`); every rank raises the same
    `RunDirError` when that fails. Returns rank 0's lock (None on the other ranks)."""
    lock, error = None, None
    if dist.is_main:
        try:
            lock = acquire_run_lock(cfg.run.output_dir)
            prepare_run_dir(cfg.run.output_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite,
                            log=lambda text: print(text.replace("[run]", f"[{kind}]", 1), flush=True))
        except Exception as exc:  # every rank must hear of it, or the others wait for rank 0 forever
            error = exc
            if lock is not None:
                lock.release()
    reason = broadcast_from_main(None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    if reason is not None:
        raise RunDirError(reason[1])
    return lock
