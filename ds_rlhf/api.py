"""Training from Python: `RLTrainer.from_config(cfg, reward_fns=[...], environment=...)`, and `SFTTrainer`,
`RMTrainer`, `DPOTrainer` `.from_config(cfg)`; `.train()` runs the recipe and returns a `TrainResult`.

`cfg` is a `Config`, a mapping of settings read as a --config file is (sections as sub-dicts
`{"rl": {"algo": "grpo"}}`, dotted or bare keys `{"rl.algo": "grpo"}`), or the path of a YAML/JSON file. A mapping
or a file is parsed as the training command parses it (`config.parse_config` with the command's defaults and only
the sections its trainer reads, `config_keys.RECIPES`), so a mistake is the command's one-line `ConfigError`; a
`Config` is copied and checked (`config.validate`).

Reward functions given as callables (lambdas too) run in the trainer's process: each is registered under
`python:NAME` (`rewards.loading.register`; NAME is the function's name, `lambda` for a lambda, or the key of a
`{name: fn}` mapping) and appended to `reward.fn`, so the run's config.json names it and the preflight, the
reward stage and evaluation load it like a reward from a file. Its calling convention is detected from its
signature (`rewards.calling.detect_style`: TRL's `(prompts, completions, **kwargs)`, ours `(prompt, response,
ground_truth, metadata)` or batched `(prompts, responses, ...)`, verl's, OpenRLHF's) or declared, `(fn, "trl")`.
Reward worker processes (`reward.workers` > 0) cannot take them (a lambda cannot be pickled): refused in one
line; beside the functions of a file in `reward.fn`, which `reward.workers -1` runs in workers, they run in
the trainer's process. `environment` is an environment class, a list of tool functions, or a TRL / OpenRLHF
environment (what `env.name` loads from a file, `agent/adapters.py`), given as the object and registered the
same way.

`train()` raises a user's error as the exception it is, with its one-line message (`ConfigError`, a data, run
directory or reward error), never `SystemExit`; a SIGINT (a notebook's interrupt) or SIGTERM finishes the step,
saves a checkpoint and raises `KeyboardInterrupt`. The process group stays up for the next run in the process.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ds_rlhf.agent.adapters import load_environment
from ds_rlhf.config import Config, parse_config, validate
from ds_rlhf.entrypoints.main import runtime_env_defaults
from ds_rlhf.entrypoints.train import (
    DPO_DEFAULTS,
    PPO_DEFAULTS,
    RM_DEFAULTS,
    SFT_DEFAULTS,
    run_dpo,
    run_ppo,
    run_rm,
    run_sft,
)
from ds_rlhf.errors import ConfigError
from ds_rlhf.rewards.calling import detect_style
from ds_rlhf.rewards.loading import STYLES, register
from ds_rlhf.rewards.reward_set import parse_weights
from ds_rlhf.telemetry.logger import METRICS_FILE, read_metrics

ConfigLike = Config | Mapping | str | os.PathLike


@dataclass(frozen=True)
class TrainResult:
    """What a run left: its directory, the records of its `metrics.jsonl` (one per logged step: `step`, `time` and
    the metrics) and what the recipe returned (RL: the metrics of each step; SFT / RM / DPO: `eval_before`,
    `eval_after` and `export`)."""

    run_dir: Path
    history: list[dict]
    summary: Any

    @property
    def metrics(self) -> dict:
        """The last logged record (the final step's metrics), {} when none was logged."""
        return self.history[-1] if self.history else {}

    @property
    def export_dir(self) -> Path | None:
        """The exported Hugging Face directory (`run.export_hf`), None when the run wrote none."""
        path = self.run_dir / "export"
        return path if path.is_dir() else None


def load_config(cfg: ConfigLike, recipe: str, defaults: dict) -> Config:
    """`cfg` (a Config, a mapping of settings or a YAML/JSON path) as the checked Config of `recipe`'s command."""
    if isinstance(cfg, Config):
        config = copy.deepcopy(cfg)
        return validate(config)
    if isinstance(cfg, str | os.PathLike):
        return parse_config(["--config", os.fspath(cfg)], defaults, recipe)
    if isinstance(cfg, Mapping):
        return parse_config([], defaults, recipe, settings=dict(cfg))
    raise ConfigError(f"cfg is a {type(cfg).__name__}: give a Config, a mapping of settings ({{'model.path': ...}}) "
                      "or the path of a YAML/JSON config file")


def _clean(name: str, default: str) -> str:
    """A name for `python:NAME`: word characters, dots and dashes only (no `,`, `@` or `:` of the spec syntax)."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_") or default


def _name(obj, default: str) -> str:
    name = getattr(obj, "__name__", None) or default
    return _clean("lambda" if name == "<lambda>" else str(name), default)


def reward_specs(reward_fns) -> list[str]:
    """The `python:NAME[@style]` spec of each callable of `reward_fns` (a callable, a sequence of callables or
    `(callable, style)` pairs, or a `{name: callable}` mapping); a non-callable is a one-line ConfigError."""
    if callable(reward_fns) or isinstance(reward_fns, tuple) and len(reward_fns) == 2 and isinstance(
            reward_fns[1], str):
        reward_fns = [reward_fns]
    if isinstance(reward_fns, str) or not isinstance(reward_fns, Mapping | Sequence):
        raise ConfigError(f"reward_fns is a {type(reward_fns).__name__}: give a list of callables (built-in rules and "
                          "file.py:name go in reward.fn)")
    items = list(reward_fns.items()) if isinstance(reward_fns, Mapping) else list(enumerate(reward_fns))
    specs = []
    for key, item in items:
        fn, style = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], str) else (item, None)
        where = f"reward_fns[{key!r}]"
        if not callable(fn):
            raise ConfigError(f"{where} is a {type(fn).__name__} ({fn!r:.60}), not a callable: pass a function "
                              "(built-in rules and file.py:name go in reward.fn)")
        if style is not None and style not in STYLES:
            raise ConfigError(f"{where}: calling convention {style!r} is not one of {', '.join(STYLES)}")
        try:
            detect_style(fn)  # a bad `reward_style` attribute is refused now
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        name = _clean(key, "reward") if isinstance(key, str) else _name(fn, "reward")
        specs.append(register(name, fn) + (f"@{style}" if style else ""))
    return specs


def add_rewards(cfg: Config, reward_fns, reward_weights: Sequence[float] | None) -> None:
    """Append the callables' specs to `reward.fn` and set `reward.weights`: `reward_weights` (one per reward
    function, the config's own first), else the config's weights with 1 for each callable."""
    old = [p for p in cfg.reward.fn.split(",") if p.strip()]
    new = reward_specs(reward_fns) if reward_fns is not None else []
    if new and cfg.reward.workers > 0:
        raise ConfigError(f"reward.workers={cfg.reward.workers} runs reward functions in worker processes, which "
                          "cannot take the callables of reward_fns (a lambda cannot be pickled): set "
                          "reward.workers 0, or give the function as reward.fn path/to/file.py:name")
    try:
        if reward_weights is not None:
            weights = parse_weights(list(reward_weights), len(old) + len(new))
        elif new and cfg.reward.weights:
            weights = parse_weights(cfg.reward.weights, len(old)) + [1.0] * len(new)
        else:
            weights = None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"reward_weights: {exc}") from None
    cfg.reward.fn = ",".join([*old, *new])
    if weights is not None:
        cfg.reward.weights = ",".join(repr(w) for w in weights)


def add_environment(cfg: Config, environment) -> None:
    """Set `env.name` to `environment` (a `file.py:Name` spec, or the object, registered as `python:NAME`)
    and load it once now, so an environment of no known shape is refused before the run starts."""
    if environment is None:
        return
    if cfg.env.name:
        raise ConfigError(f"env.name={cfg.env.name!r} is set in the config and environment= is given "
                          "too: give one of them")
    if isinstance(environment, str):
        cfg.env.name = environment
    else:
        default = "tools" if isinstance(environment, list | tuple) else type(environment).__name__
        cfg.env.name = register(_name(environment, default), environment)
    load_environment(cfg.env.name)


class _Trainer:
    """One recipe run from Python: the config is checked by `from_config`, the run happens in `train()`."""

    RECIPE: ClassVar[str]
    DEFAULTS: ClassVar[dict]
    RUN: ClassVar[Callable[[Config], Any]]

    def __init__(self, cfg: Config):
        if not isinstance(cfg, Config):
            raise TypeError(f"{type(self).__name__}(cfg) takes a Config; use {type(self).__name__}.from_config(cfg) "
                            "for a mapping of settings or a file path")
        self.cfg = cfg

    @classmethod
    def from_config(cls, cfg: ConfigLike):
        runtime_env_defaults()  # as the commands: the CPU accelerator without a GPU, no tokenizers thread pool
        return cls(load_config(cfg, cls.RECIPE, cls.DEFAULTS))

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.output_dir)

    def train(self) -> TrainResult:
        """Run the recipe; the run's directory, its metrics records and what the recipe returned."""
        runtime_env_defaults()
        try:
            summary = type(self).RUN(self.cfg)
        except SystemExit as exc:  # a signal stopped the run after saving its checkpoint: 128 + the signal
            if isinstance(exc.code, int) and exc.code > 128:
                raise KeyboardInterrupt(f"stopped by signal {exc.code - 128}; the last checkpoint is under "
                                        f"{self.run_dir / 'checkpoints'} (run.resume latest continues)") from None
            raise
        metrics = self.run_dir / METRICS_FILE
        return TrainResult(self.run_dir, read_metrics(self.run_dir) if metrics.is_file() else [], summary)


class SFTTrainer(_Trainer):
    """Supervised fine-tuning on an `sft` store (`ds-rlhf train-sft`)."""

    RECIPE, DEFAULTS, RUN = "train-sft", SFT_DEFAULTS, staticmethod(run_sft)


class RMTrainer(_Trainer):
    """Reward-model training on a `preference` store (`ds-rlhf train-rm`)."""

    RECIPE, DEFAULTS, RUN = "train-rm", RM_DEFAULTS, staticmethod(run_rm)


class DPOTrainer(_Trainer):
    """Direct preference optimisation on a `preference` store (`ds-rlhf train-dpo`)."""

    RECIPE, DEFAULTS, RUN = "train-dpo", DPO_DEFAULTS, staticmethod(run_dpo)


class RLTrainer(_Trainer):
    """RL (PPO, GRPO, ...) on a prompt store (`ds-rlhf train-ppo`), with rewards and an environment from Python."""

    RECIPE, DEFAULTS, RUN = "train-ppo", PPO_DEFAULTS, staticmethod(run_ppo)

    @classmethod
    def from_config(cls, cfg: ConfigLike, reward_fns=None, *, reward_weights: Sequence[float] | None = None,
                    environment=None) -> RLTrainer:
        """`reward_fns`: callables (see the module doc), added to the config's `reward.fn` if it names some;
        `reward_weights`: one per reward function (the config's first); `environment`: an environment object (or
        a `file.py:Name` spec) for `env.name`."""
        trainer = super().from_config(cfg)
        add_rewards(trainer.cfg, reward_fns, reward_weights)
        add_environment(trainer.cfg, environment)
        validate(trainer.cfg)
        return trainer


__all__ = ["DPOTrainer", "RLTrainer", "RMTrainer", "SFTTrainer", "TrainResult", "load_config"]
