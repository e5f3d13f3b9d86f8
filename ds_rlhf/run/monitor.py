"""What a training loop tells an operator besides `metrics.jsonl`; rank 0 does all of it, nothing is collective:

- `run_dir/environment.json` at start: `ds-rlhf doctor --json` for this machine and this config (the run report's
  environment section); the doctor's probes are bounded, a second or two once torch is imported;
- `run_dir/status.json`: `running` at start, then at exit `finished`, `failed` (the exception's type and message,
  the traceback's tail and whether it was an out-of-memory error) or `stopped` (by which signal). A `kill -9` or a
  second signal (which exits at once) leaves `running`: `ds-rlhf report` then tells a live run from a dead one by
  the run lock;
- health warnings after each step (`run.health`, with `run.health_warnings`): each new warning printed once, with
  its likely cause, and `health/warnings` (how many are active) in the step's metrics; a policy collapse
  (`health.ONCE`) is printed once per run and kept in `status.json`'s `health` (a list of `{kind, step, message}`),
  written when it is raised;
- the live Prometheus endpoint (`telemetry.prometheus`) when `run.metrics_port` > 0, fed with each step's metrics.

None of it ever stops a run: a failure here is one printed line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque
from pathlib import Path

from ds_rlhf.atomic_files import write_text_atomic
from ds_rlhf.run.environment import apply_config, doctor_json, run_checks
from ds_rlhf.run.health import ONCE, health_warnings
from ds_rlhf.run.run_dir import checkpoints_dir, complete_checkpoints
from ds_rlhf.telemetry.prometheus import PrometheusExporter

STATUS_FILE = "status.json"
ENV_FILE = "environment.json"
OOM_PATTERNS = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "no available memory for the cache",
                "insufficient memory", "cannot allocate memory")


def is_oom(text: str) -> bool:
    """Whether an error message or a log tail reads like an out-of-memory failure (CUDA, vLLM's KV cache, host)."""
    low = text.lower()
    return any(p in low for p in OOM_PATTERNS)


def exit_status(exc: BaseException | None) -> dict:
    """How a run ended, from the exception leaving the loop (None: it finished)."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return {"status": "finished", "exit_code": 0}
    if isinstance(exc, KeyboardInterrupt):
        return {"status": "stopped", "signal": "SIGINT", "exit_code": 128 + signal.SIGINT}
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        try:  # GracefulStop exits with 128 + the signal after its checkpoint
            return {"status": "stopped", "signal": signal.Signals(exc.code - 128).name, "exit_code": exc.code}
        except ValueError:
            pass
    message = str(exc)
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])[-4000:]
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    return {"status": "failed", "exit_code": code,
            "error": {"type": type(exc).__name__, "message": message[:4000],
                      "oom": is_oom(f"{type(exc).__name__} {message}"), "traceback": tail}}


def interrupted_line(run_dir: Path, step: int) -> str:
    """What a Ctrl-C outside the training loop's handler (while a run starts, say) leaves: the step and the newest
    checkpoint to resume from."""
    done = complete_checkpoints(checkpoints_dir(run_dir))
    where = (f"the newest checkpoint is {done[-1]} (--run.resume latest continues from it)" if done else
             "no checkpoint was saved")
    return f"interrupted (Ctrl-C) {f'at step {step}' if step else 'while the run was starting'}; {where}"


def _write_json(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")  # a reader never sees half a file


def read_status(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def doctor_data_dir(cfg, run_dir: Path) -> Path:
    """The prompt/data store's directory when this process may write its probe file there, else the run dir."""
    store = Path(cfg.data.train) if cfg.data.train else None
    if store is not None and store.is_dir() and os.access(store, os.W_OK):
        return store
    return run_dir


def write_environment(cfg, run_dir: str | os.PathLike) -> float:
    """`run_dir/environment.json`: the doctor's checks for this machine and config; returns the seconds taken."""
    run_dir = Path(run_dir)
    start = time.perf_counter()
    results = apply_config(run_checks(doctor_data_dir(cfg, run_dir)), cfg)
    seconds = time.perf_counter() - start
    _write_json(run_dir / ENV_FILE, doctor_json(results, seconds))
    return seconds


class RunMonitor:
    """One per run: `start()` once the run directory is claimed, `after_step(step, metrics)` before each record is
    logged, `finish(exc, step)` at exit (idempotent). Inactive (does nothing) on ranks other than 0."""

    def __init__(self, cfg, run_dir: str | os.PathLike, *, is_main: bool, kind: str, total_steps: int = 0,
                 print_fn=print, environment: bool = True):
        self.cfg, self.run_dir, self.kind = cfg, Path(run_dir), kind
        self.active, self.total_steps, self.print = is_main, int(total_steps), print_fn
        self.environment = environment
        self.health = bool(cfg.run.health_warnings)
        self.collapse_steps = int(cfg.run.health_collapse_steps)
        self.collapses: list[dict] = []  # the ONCE warnings raised, for status.json's `health`
        self._status: dict = {}
        self.exporter = None
        self.started = time.time()
        self._history: deque[dict] = deque(maxlen=64)
        self._active_warnings: set[tuple[str, str]] = set()
        self.warnings_raised = 0
        self._finished = False

    @classmethod
    def for_run(cls, ctx, kind: str, total_steps: int) -> RunMonitor:
        """Built from a RunContext and started (environment.json, status.json, the metrics endpoint)."""
        monitor = cls(ctx.cfg, ctx.run_dir, is_main=ctx.dist.is_main, kind=kind, total_steps=total_steps,
                      print_fn=ctx.print)
        monitor.start()
        return monitor

    def _guard(self, what: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - operator extras never stop a run
            print(f"[{self.kind}] {what} skipped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return None

    def start(self) -> None:
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_status({"status": "running"})
        if self.environment:
            seconds = self._guard("environment.json", lambda: write_environment(self.cfg, self.run_dir))
            if seconds is not None and seconds > 5:
                self.print(f"[{self.kind}] environment.json took {seconds:.1f}s (the doctor's probes)")
        port = int(self.cfg.run.metrics_port)
        if port > 0:
            self.exporter = self._guard("metrics endpoint",
                                        lambda: PrometheusExporter(port, addr=self.cfg.run.metrics_host or None,
                                                                   total_steps=self.total_steps))
            if self.exporter is not None and self.exporter.active:
                self.print(f"[{self.kind}] live metrics on port {port} ({self.exporter.url})")

    def set_printer(self, print_fn) -> None:
        """Print through the loop's progress bar (`MetricsLogger.print`) once it exists."""
        self.print = print_fn

    def after_step(self, step: int, metrics: dict) -> dict:
        """The step's metrics with `health/warnings` added (rank 0, run.health_warnings); prints each new warning
        once and feeds the metrics endpoint. Call it before `MetricsLogger.log`."""
        if not self.active:
            return metrics
        if self.health:
            metrics = {**metrics, "health/warnings": float(self._health(step, metrics))}
        if self.exporter is not None:
            self._guard("metrics update", lambda: self.exporter.update(step, metrics))
        return metrics

    def _health(self, step: int, metrics: dict) -> int:
        self._history.append({"step": step, **metrics})
        found = health_warnings(list(self._history), collapse_steps=self.collapse_steps)
        now = {(w.kind, w.cause) for w in found}
        raised = {c["kind"] for c in self.collapses}
        new = [w for w in found if (w.kind, w.cause) not in self._active_warnings and w.kind not in raised]
        for w in new:
            self.print(f"[health] {w.message}")
        self._active_warnings = now
        once = [{"kind": w.kind, "step": w.step, "message": w.message} for w in new if w.kind in ONCE]
        if once:
            self.collapses += once
            self._write_status(self._status)
        self.warnings_raised += len(new)
        if new and self.exporter is not None:
            self.exporter.count_warnings([w.kind for w in new])
        return len(found)

    def _write_status(self, fields: dict) -> None:
        self._status = fields
        status = {**fields, "kind": self.kind, "total_steps": self.total_steps, "health": self.collapses,
                  "pid": os.getpid(),
                  "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                         time.localtime(self.started))}
        self._guard("status.json", lambda: _write_json(self.run_dir / STATUS_FILE, status))

    def finish(self, exc: BaseException | None, step: int) -> None:
        """Write the final status.json and stop the metrics endpoint (once; later calls do nothing)."""
        if self._finished:
            return
        self._finished = True
        if isinstance(exc, KeyboardInterrupt) and not exc.args:  # the one line `cli.run_entry` prints
            exc.args = (interrupted_line(self.run_dir, step),)
        if self.exporter is not None:
            self._guard("metrics endpoint close", self.exporter.close)
        if not self.active:
            return
        fields = exit_status(exc)
        fields.update(step=int(step), seconds=round(time.time() - self.started, 1),
                      ended=time.strftime("%Y-%m-%d %H:%M:%S"), health_warnings=self.warnings_raised)
        self._write_status(fields)
