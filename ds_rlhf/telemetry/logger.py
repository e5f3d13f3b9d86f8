"""MetricsLogger: one call per step writes JSONL, TensorBoard and wandb (offline without a key), rank 0 only.

wandb never crashes a run: without an API key or network it runs in offline mode, and if it cannot start at all
the run continues with a warning.

On the console: a progress bar when stderr is a terminal (its postfix shows the step's `postfix_keys` by their full
names, e.g. `reward/mean=0.42`), else one summary line per step (`run.log_every` N: every N steps). While the bar
is drawn, every logging handler writing to the terminal (vLLM's, the root logger's) writes through `tqdm.write`,
so other output appears above the bar instead of tearing it.

`metrics.jsonl` survives crashes: a torn last line (the process died, or the disk filled, mid-write) is skipped
with a warning by `read_metrics`, cut off before the logger appends to the file again, and dropped by
`truncate_metrics`, which rewrites the log for a resume atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

from ds_rlhf.atomic_files import write_text_atomic
from ds_rlhf.redaction import redact_urls

METRICS_FILE = "metrics.jsonl"


def _scalar(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def console_loggers() -> list[logging.Logger]:
    """The root logger and every named logger with a handler writing to stdout or stderr."""
    named = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return [lg for lg in [logging.root, *named]
            if any(isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr)
                   for h in lg.handlers)]


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
        self._redirect = ExitStack()
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # append: a resumed run continues the same log (it is truncated to the checkpoint step on resume)
        cut_torn_tail(self.run_dir / METRICS_FILE)
        self._jsonl = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115 (closed in close())
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except Exception as exc:  # tensorboard missing: say so, keep going
                print(f"[telemetry] tensorboard disabled: {exc}", file=sys.stderr)
        if wandb:
            self._wandb = self._start_wandb(wandb_project, config)
        if progress and total_steps and sys.stderr.isatty():
            self._start_bar(total_steps, start_step)
        elif not self.log_every:
            self.log_every = 1  # no bar: a summary line per step

    def _start_bar(self, total_steps: int, start_step: int) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, desc=self.desc, dynamic_ncols=True)
        self._redirect.enter_context(logging_redirect_tqdm(loggers=console_loggers(), tqdm_class=type(self._bar)))

    def _start_wandb(self, project: str, config: dict | None):
        try:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            # wandb records the command line too: it sees it with the secrets of its URLs masked
            argv, sys.argv = sys.argv, [*sys.argv[:1], *(redact_urls(a) for a in sys.argv[1:])]
            try:
                return wandb.init(project=project, dir=str(self.run_dir), config=config or {}, mode=mode,
                                  name=self.run_dir.name, resume="allow")
            finally:
                sys.argv = argv
        except Exception as exc:
            print(f"[telemetry] wandb disabled: {exc}", file=sys.stderr)
            return None

    @property
    def tensorboard_writer(self):
        """The run's TensorBoard SummaryWriter (rank 0 with run.tensorboard), else None: for other writers
        (e.g. `telemetry.samples.SampleLogger`) to add to the same event files."""
        return self._tb

    @property
    def wandb_run(self):
        """The run's wandb run (rank 0 with run.wandb, when it started), else None."""
        return self._wandb

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
            self._bar.set_postfix({k: f"{clean[k]:.3g}" for k in self._postfix_keys if k in clean})
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
        self._redirect.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl.close()


def parse_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) for each record of a metrics file; a torn last line is skipped with a warning, a bad line
    elsewhere raises naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((line, json.loads(line)))
        except json.JSONDecodeError as exc:
            if all(not rest.strip() for rest in lines[number:]):
                warnings.warn(f"{path}: skipping a torn last line (line {number}, {len(line)} bytes: the run "
                              "stopped mid-write)", stacklevel=3)
                break
            raise ValueError(f"{path}, line {number}: not a JSON record ({exc})") from None
    return records


def cut_torn_tail(path: Path) -> None:
    """Before appending: drop a partial last line so the next record does not glue onto it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        block = min(size, 1 << 20)
        f.seek(size - block)
        tail = f.read(block)
        cut = tail.rfind(b"\n")
        keep = size - block + cut + 1 if cut >= 0 else 0
        warnings.warn(f"{path}: dropping a torn last line ({size - keep} bytes: the run stopped mid-write)",
                      stacklevel=3)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of `<run_dir>/metrics.jsonl` (a torn last line is skipped with a warning)."""
    return [record for _, record in parse_lines(Path(run_dir) / METRICS_FILE)]


def truncate_metrics(run_dir: str | Path, step: int) -> int:
    """On resume, drop records after `step` (the checkpoint's) so the log matches an uninterrupted run.

    Call on rank 0 only, before the MetricsLogger opens the file. The new file is written beside the old one, fsynced
    and renamed over it, so a crash here leaves either log whole. Returns the number of records dropped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    records = parse_lines(path)
    kept = [(line, r) for line, r in records if not isinstance(r.get("step"), int | float) or r["step"] <= step]
    steps = [r["step"] for _, r in kept if isinstance(r.get("step"), int | float)]
    if step > 0 and (not steps or max(steps) < step):
        warnings.warn(f"{path} ends at step {max(steps) if steps else 0} but the checkpoint is at step {step}: "
                      "the log has no records for the steps in between (they were not flushed before the crash)",
                      stacklevel=2)
    rewrite_lines(path, [line for line, _ in kept])
    return len(records) - len(kept)


def rewrite_lines(path: Path, lines: list[str]) -> None:
    """Replace a JSONL file atomically (`atomic_files.write_text_atomic`): a crash leaves either the old or the new
    file whole."""
    write_text_atomic(path, "".join(line + "\n" for line in lines))
