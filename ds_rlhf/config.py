"""One config schema for every entry point (SFT, RM, PPO/GRPO).

A run's settings come from, in order: the schema's defaults, the entry point's defaults, a YAML/JSON file
(`--config`), then `--key value` overrides on the command line. Keys are `section.key` (`--rl.kl_coef 0.05`) or the
bare key when it is unique across sections (`--kl_coef 0.05`). Unknown or misspelled keys are errors with a
suggestion, never silently ignored. The resolved config is printed and saved in the run directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config key or value the schema does not accept."""


@dataclass
class ModelConfig:
    path: str = "tiny"  # HF directory; "tiny" / "tiny:small" build the offline tiny model
    tokenizer: str = ""  # defaults to `path`
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: bf16 on GPUs that support it, fp32 on CPU)
    attn_impl: str = "auto"  # auto | sdpa | eager | flash_attention_2 | varlen
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: int = 16
    lora_targets: str = "all-linear"


@dataclass
class DataConfig:
    train: str = ""  # Arrow store directory written by data_prep/
    eval: str = ""
    eval_fraction: float = 0.0  # hold out this share of `train` when `eval` is empty (SFT/RM)
    max_prompt_len: int = 256
    max_len: int = 512  # SFT/RM sequence length
    micro_batch_tokens: int = 0  # token budget per micro-batch; 0 = fixed `optim.micro_batch_size`
    shuffle: bool = True
    reader: str = "auto"  # auto | uring | mmap


@dataclass
class OptimConfig:
    lr: float = 1e-6
    critic_lr: float = 5e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 4  # sequences per micro-batch (per rank) when no token budget is set
    batch_size: int = 32  # SFT/RM: sequences (pairs) per optimizer step per rank
    rm_margin: float = 0.0  # RM: margin in the Bradley-Terry loss -log sigmoid(r_c - r_r - margin)


@dataclass
class RolloutConfig:
    backend: str = "auto"  # auto (vLLM if importable, else HF generate) | vllm | hf
    placement: str = "colocated"  # colocated | disaggregated
    n_samples: int = 4  # responses per prompt
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_model_len: int = 0  # 0 = max_prompt_len + max_new_tokens
    gpu_memory_utilization: float = 0.5
    sleep: bool = True  # free vLLM weights + KV cache while DeepSpeed trains (GPU only)
    sleep_level: int = 2  # 1: keep a CPU copy of the weights; 2: drop them (every wake is followed by a full sync)
    devices: str = ""  # disaggregated: GPU ids for the vLLM server, e.g. "4,5,6,7" (must not hold a training rank)
    tensor_parallel_size: int = 1  # vLLM tensor parallelism (disaggregated: over `devices`; colocated: over ranks)
    bucket_mb: int = 1024  # weight-sync gather bucket
    canary_threshold: float = 0.0  # 0 = backend default; max |logp_trainer - logp_rollout| allowed after a sync


@dataclass
class RLConfig:
    algo: str = "grpo"  # ppo | grpo | dr_grpo (with loss_agg const-norm) | rloo | reinforce_pp | reinforce_pp_baseline
    prompts_per_step: int = 8
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # rollouts per optimizer step; 0 = all of a step's rollouts
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0  # 0 = off; else the dual-clip constant c > 1
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in: str = "loss"  # loss | reward
    kl_target: float = 0.0  # > 0 turns on the adaptive controller
    kl_horizon: int = 10000
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | const-norm
    mismatch: str = "tis"  # tis (token-level truncated IS) | mis (sequence masking) | off
    tis_cap: float = 2.0
    reward_fn: str = ""  # gsm8k | format | path/to/file.py:func (empty when reward_model is set)
    reward_model: str = ""  # HF dir of a sequence-classification reward model
    on_bad_reward: str = "fail"  # fail | zero | drop
    critic_path: str = ""  # default: reward_model if set, else the actor
    critic_init: str = "auto"  # auto | reward | actor


@dataclass
class RunConfig:
    output_dir: str = "runs/latest"
    steps: int = 20  # RL steps, or optimizer steps for SFT/RM (0 = run `epochs`)
    epochs: int = 1
    save_every: int = 0  # 0 = only at the end
    eval_every: int = 0
    keep_last: int = 2  # complete checkpoints kept (>= 1; 0 = keep all); the newest is never deleted
    resume: str = ""  # "" | latest | path to a checkpoint directory
    overwrite: bool = False  # start fresh in a run directory that holds another run's checkpoints (deletes them)
    resume_fallback: bool = False  # if the newest checkpoint fails verification, resume from the newest valid one
    seed: int = 0
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "ds_rlhf"
    export_hf: bool = True
    progress: bool = True
    log_every: int = 0  # also print a one-line summary every N steps (for logs that are not a terminal)
    dist_timeout_minutes: float = 30.0  # a collective that waits longer fails the run loudly (lost rank or node)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ds_config: str = "ds_configs/zero2.json"
    zero_stage: int = -1  # -1 = as in ds_config
    offload: bool = False  # offload optimizer (and ZeRO-3 params) to CPU
    local_rank: int = -1  # set by the `deepspeed` launcher; accepted and ignored otherwise

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


SECTIONS = [name for name, typ in _field_types(Config).items() if dataclasses.is_dataclass(typ)]


def _all_keys() -> dict[str, tuple[str | None, str]]:
    """Every accepted dotted key -> (section or None, field)."""
    keys: dict[str, tuple[str | None, str]] = {}
    for name, typ in _field_types(Config).items():
        if dataclasses.is_dataclass(typ):
            for sub in _field_types(typ):
                keys[f"{name}.{sub}"] = (name, sub)
        else:
            keys[name] = (None, name)
    return keys


def _resolve_key(key: str) -> tuple[str | None, str]:
    keys = _all_keys()
    key = key.replace("-", "_")
    if key in keys:
        return keys[key]
    bare = [k for k in keys if k.split(".")[-1] == key]
    if len(bare) == 1:
        return keys[bare[0]]
    if len(bare) > 1:
        raise ConfigError(f"ambiguous config key '{key}': use one of {', '.join(sorted(bare))}")
    close = difflib.get_close_matches(key, list(keys) + sorted({k.split('.')[-1] for k in keys}), n=3)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}; see --help for the list")


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
        origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if origin is tuple:
            items = value if isinstance(value, list | tuple) else str(value).split(",")
            args = typing.get_args(typ)
            if len(items) != len(args):
                raise ValueError(f"expected {len(args)} comma-separated values")
            return tuple(_coerce(v, t, key) for v, t in zip(items, args))
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return "" if value is None else str(value)
    except (TypeError, ValueError) as exc:
        expected = getattr(typ, "__name__", typ)
        raise ConfigError(f"bad value {value!r} for '{key}' (expected {expected}): {exc}") from None
    return value


def set_value(cfg: Config, key: str, value: Any) -> None:
    section, name = _resolve_key(key)
    target = getattr(cfg, section) if section else cfg
    typ = _field_types(type(target))[name]
    setattr(target, name, _coerce(value, typ, key))


def apply_mapping(cfg: Config, mapping: dict, prefix: str = "") -> None:
    """Apply a nested dict (from YAML/JSON): sections as sub-dicts, or dotted/bare keys at top level."""
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and full in SECTIONS:
            apply_mapping(cfg, value, prefix=f"{full}.")
        else:
            set_value(cfg, full, value)


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data


def _split_overrides(argv: list[str]) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': settings are given as --key value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:  # a bare flag: only booleans may omit their value
            value = None
            i += 1
        pairs.append((key, value))
    return pairs


def parse_config(argv: list[str], defaults: dict | None = None) -> Config:
    """Build a Config from entry-point defaults, an optional --config file and --key value overrides."""
    cfg = Config()
    apply_mapping(cfg, defaults or {})
    pairs = _split_overrides(argv)
    for key, value in pairs:
        if key == "config":
            if value is None:
                raise ConfigError("--config needs a file path")
            apply_mapping(cfg, load_file(value))
    for key, value in pairs:
        if key == "config":
            continue
        if value is None:
            section, name = _resolve_key(key)
            target = getattr(cfg, section) if section else cfg
            if _field_types(type(target))[name] is not bool:
                raise ConfigError(f"--{key} needs a value")
            value = "true"
        set_value(cfg, key, value)
    return cfg


def _field_comments(cls) -> dict[str, str]:
    """The `# comment` after each field in the class source: the schema documents itself once."""
    import inspect
    import re

    found = re.findall(r"^\s+(\w+): [^=]+=.*?#\s*(.+)$", inspect.getsource(cls), flags=re.M)
    return dict(found)


def help_text(cfg: Config | None = None) -> str:
    """Every key with its default (or current value) and its comment, grouped by section, for --help."""
    cfg = cfg or Config()
    lines = []
    top = _field_comments(Config)
    for name, typ in _field_types(Config).items():
        if dataclasses.is_dataclass(typ):
            lines.append(f"[{name}]")
            notes = _field_comments(typ)
            for sub, value in dataclasses.asdict(getattr(cfg, name)).items():
                note = f"  # {notes[sub]}" if sub in notes else ""
                lines.append(f"  --{name}.{sub} {value!r}{note}")
        else:
            note = f"  # {top[name]}" if name in top else ""
            lines.append(f"--{name} {getattr(cfg, name)!r}{note}")
    return "\n".join(lines)
