"""One rule between the run's settings and its DeepSpeed config file (the Hugging Face Trainer's): a setting given on
the command line or in a --config file, and a different explicit value of it in the ds_config file, is an error
naming both. `"auto"` (or no key) in the file takes the run's value; an explicit file value with the setting left
at its default is kept (the run prints it when it resolves the file). `--zero_stage` and `--offload` are the
exception: they exist to override the file's ZeRO stage and offload.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ds_rlhf.ds_config_file import FILE_KEYS, file_value, load_ds_config, same_value
from ds_rlhf.errors import ConfigError

# the settings that decide how many micro-batches make an optimizer step, per recipe family
BATCH_KEYS = {"rl": ("rl.mini_batch_size", "rl.prompts_per_step", "rollout.n_samples", "optim.micro_batch_size"),
              "supervised": ("optim.batch_size", "optim.micro_batch_size")}


def _setting(cfg: Any, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def _accumulation(cfg: Any, recipe: str | None) -> tuple[int, tuple[str, ...]] | None:
    """(micro-batches per optimizer step per rank, the settings deciding it), or None where a token budget
    (data.micro_batch_tokens) makes the count vary from step to step."""
    if cfg.data.micro_batch_tokens > 0:
        return None
    micro = max(1, cfg.optim.micro_batch_size)
    if recipe == "train-ppo":
        rollouts = cfg.rl.mini_batch_size or cfg.rl.prompts_per_step * cfg.rollout.n_samples
        return math.ceil(rollouts / micro), BATCH_KEYS["rl"]
    if recipe is not None:
        return max(1, cfg.optim.batch_size // micro), BATCH_KEYS["supervised"]
    return None


def _batch_conflicts(cfg: Any, raw: dict, recipe: str | None) -> list[str]:
    found = _accumulation(cfg, recipe)
    if found is None or not any(key in cfg.given for key in found[1]):
        return []
    steps, keys = found
    settings = ", ".join(f"{key}={_setting(cfg, key)}" for key in keys)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = []
    for key, ours in (("gradient_accumulation_steps", steps),
                      ("train_batch_size", max(1, cfg.optim.micro_batch_size) * steps * world)):
        theirs = file_value(raw, key)
        if theirs is not None and not same_value(ours, theirs):
            out.append(f"the settings ({settings}) make {key} {ours} and the ds_config file sets {key}={theirs!r}")
    return out


def conflicts(cfg: Any, raw: dict, recipe: str | None = None) -> list[str]:
    """Each given setting whose explicit value in the DeepSpeed config dict `raw` differs, as a phrase."""
    out = []
    for setting, file_keys in FILE_KEYS.items():
        if setting not in cfg.given or (setting == "optim.critic_lr" and recipe not in (None, "train-ppo")):
            continue
        ours = _setting(cfg, setting)
        if setting == "model.dtype" and ours == "auto":
            continue
        for file_key in file_keys:
            theirs = file_value(raw, file_key)
            want = ours == file_key.split(".")[0] if setting == "model.dtype" else ours
            if theirs is not None and not same_value(want, theirs):
                out.append(f"{setting}={ours!r} is given and the ds_config file sets {file_key}={theirs!r}")
    return out + _batch_conflicts(cfg, raw, recipe)


def check_file_precedence(cfg: Any, recipe: str | None = None) -> None:
    """ConfigError naming both values where a given setting and the ds_config file disagree. A file that cannot be
    read here is left to the run's own check (`run/preflight.py`), which names its problem."""
    if not cfg.given:
        return
    try:
        raw = load_ds_config(cfg.ds_config)
    except (OSError, ValueError):
        return
    found = conflicts(cfg, raw if isinstance(raw, dict) else {}, recipe)
    if found:
        raise ConfigError(f"{'; '.join(found)} ({cfg.ds_config}): keep one of the two (\"auto\" in the file takes "
                          "the setting)")
