"""MetricsLogger: one call per step writes JSONL, TensorBoard and wandb (offline without a key), rank 0 only.

wandb never crashes a run: without an API key or network it runs in offline mode, and if it cannot start at all
the run continues with a warning.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def _scalar(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, rank: int = 0, total_steps: int = 0, start_step: int = 0,
                 tensorboard: bool = True, wandb: bool = False, wandb_project: str = "ds_rlhf",
                 config: dict | None = None, progress: bool = True, desc: str = "train",
                 postfix_keys: tuple[str, ...] = (), log_every: int = 0):
        self.active = rank == 0
        self.desc, self.total_steps, self.log_every = desc, total_steps, log_every
        self.run_dir = Path(run_dir)
        self._tb = self._wandb = self._bar = None
        self._postfix_keys = postfix_keys
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # append: a resumed run continues the same log (it is truncated to the checkpoint step on resume)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except Exception as exc:  # tensorboard missing: say so, keep going
                print(f"[telemetry] tensorboard disabled: {exc}", file=sys.stderr)
        if wandb:
            self._wandb = self._start_wandb(wandb_project, config)
        if progress and total_steps:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)

    def _start_wandb(self, project: str, config: dict | None):
        try:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            return wandb.init(project=project, dir=str(self.run_dir), config=config or {}, mode=mode,
                              name=self.run_dir.name, resume="allow")
        except Exception as exc:
            print(f"[telemetry] wandb disabled: {exc}", file=sys.stderr)
            return None

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        record = {"step": step, "time": time.time(), **{k: (v if math.isfinite(v) else str(v))
                                                       for k, v in clean.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({k.split("/")[-1]: f"{clean[k]:.3g}" for k in self._postfix_keys if k in clean})
        shown = "  ".join(f"{k} {clean[k]:.4g}" for k in self._postfix_keys if k in clean)
        if self.log_every and shown and (step % self.log_every == 0 or step == self.total_steps):
            self.print(f"[{self.desc}] step {step}/{self.total_steps}  {shown}")

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
