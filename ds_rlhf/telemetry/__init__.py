"""Metrics out of a run: JSONL always, TensorBoard and wandb when enabled, a console progress bar, phase timers."""

from ds_rlhf.telemetry.logger import MetricsLogger
from ds_rlhf.telemetry.system import system_stats
from ds_rlhf.telemetry.timer import PhaseTimer

__all__ = ["MetricsLogger", "PhaseTimer", "system_stats"]
