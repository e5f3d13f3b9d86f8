"""One config schema for every entry point (SFT, RM, PPO/GRPO, DPO).

A run's settings come from, in order: the schema's defaults, the entry point's defaults, a YAML/JSON file
(`--config`), then `--key value` overrides on the command line. Keys are `section.key` (`--rl.kl_coef 0.05`) or the
bare key when it is unique among the command's sections (`--kl_coef 0.05`). An RL run's settings are in sections by
role: `rl` (the algorithm), `reward`, `critic`, `eval`, `env`; their `rl.<name>` spellings read as the section's
key with one note (`config_rl_names`). A training command reads only its
trainer's sections (`config_keys.RECIPES`); another trainer's setting, a peer trainer's name without our meaning
(`config_peers`) and unknown or misspelled keys are errors naming what to use, never silently ignored. A given setting
that the ds_config file sets otherwise is an error (`config_precedence`). The resolved config is saved as
`config.json` in the run directory; the log names the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import ds_rlhf.algos  # noqa: F401  (registers the built-in entries)
from ds_rlhf import config_keys, config_peers
from ds_rlhf.algos.registry import ALL
from ds_rlhf.atomic_files import write_text_atomic
from ds_rlhf.config_files import load_file
from ds_rlhf.config_precedence import check_file_precedence
from ds_rlhf.config_rl import RLConfig
from ds_rlhf.config_rl_sections import CriticConfig, EnvConfig, EvalConfig, RewardConfig
from ds_rlhf.config_rules import check_cross_section
from ds_rlhf.config_sections import (  # noqa: F401 - re-exported: the schema's public names
    DataConfig,
    DPOConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    fp8_fp32_refusal,
    opt,
)
from ds_rlhf.errors import ConfigError
from ds_rlhf.redaction import redacted


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    run: RunConfig = field(default_factory=RunConfig)
    ds_config: str = "ds_configs/zero2.json"
    zero_stage: int = opt(-1, choices=(-1, 0, 1, 2, 3))  # -1 = as in ds_config
    offload: bool = False  # offload optimizer (and ZeRO-3 params) to CPU
    local_rank: int = -1  # set by the `deepspeed` launcher; accepted and ignored otherwise
    # dotted keys a --config file or the command line set (parse_config; not entry-point defaults): settings a
    # run may choose itself when the user left them, e.g. the memory split under run.max_gpu_memory_gb
    given: ClassVar[frozenset] = frozenset()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        """Every float is finite, every field's rule (choices, bounds) holds, then each section's own cross-field
        rules, then the rules across sections (`config_rules.check_cross_section`); raises ConfigError."""
        for key, (section, name) in _all_keys().items():
            target = getattr(self, section) if section else self
            value = getattr(target, name)
            _check_finite(key, value)
            rule = _field_rules(type(target)).get(name)
            if rule:
                _check_rule(key, value, rule)
                if isinstance(rule.get("choices"), str):  # a registry's alias is stored as its canonical name
                    setattr(target, name, registry_of(rule).canonical(value))
        for section in SECTIONS:
            check = getattr(getattr(self, section), "check", None)
            if check is not None:
                check()
        check_cross_section(self)

    def context_len(self) -> int:
        """The rollout context: the most tokens a rollout sequence holds, prompt included (the rollout engine's
        max_model_len): `rollout.max_model_len`, else `data.max_prompt_len + rollout.max_new_tokens`."""
        return self.rollout.max_model_len or self.data.max_prompt_len + self.rollout.max_new_tokens

    def save(self, path: str | Path) -> None:
        """The config as JSON at `path`, secrets masked, replaced whole (a run rewrites its config.json)."""
        write_text_atomic(path, json.dumps(redacted(self.to_dict()), indent=2, sort_keys=True) + "\n")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


SECTIONS = [name for name, typ in _field_types(Config).items() if dataclasses.is_dataclass(typ)]


def _field_rules(cls) -> dict[str, dict]:
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(cls) if "rule" in f.metadata}


def registry_of(rule: dict):
    """The algorithm registry a `choices="<kind>"` rule reads (`algos.registry.ALL`), its built-in entries loaded."""
    return ALL[rule["choices"]]


def choices_of(rule: dict) -> tuple:
    """The allowed values of a `choices` rule: a tuple as written, or a registry's names at this moment."""
    if isinstance(rule.get("choices"), str):
        return registry_of(rule).names()
    return tuple(rule.get("choices") or ())


def _keys_choosing(value: Any) -> list[str]:
    """The `section.key` settings whose choices include `value` (a user who wrote `--rl.algo gspo` meant
    `--rl.policy_loss gspo`)."""
    found = []
    for section in SECTIONS:
        for name, rule in _field_rules(_field_types(Config)[section]).items():
            if "choices" in rule and value in choices_of(rule):
                found.append(f"{section}.{name}")
    return found


def _check_finite(key: str, value: Any) -> None:
    """No setting is NaN or infinite: such a value passes every bound check yet breaks the run much later."""
    items = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        raise ConfigError(f"{key}={value!r}: must be a finite number (not inf or nan)")


def _check_rule(key: str, value: Any, rule: dict) -> None:
    if "choices" in rule:
        allowed = choices_of(rule)
        if value not in allowed:
            elsewhere = [other for other in _keys_choosing(value) if other != key]
            hint = f" ({value!r} is a choice of --{elsewhere[0]})" if elsewhere else ""
            raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(str, allowed))}{hint}")
    bounds = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
              "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}
    items = value if isinstance(value, tuple) else (value,)  # a tuple's bounds hold for each of its values
    each = "each value " if isinstance(value, tuple) else ""
    for name, (op, ok) in bounds.items():
        if name in rule and not all(ok(v, rule[name]) for v in items):
            raise ConfigError(f"{key}={value!r}: {each}must be {op} {rule[name]}")


def validate(cfg: Config) -> Config:
    """Check a config built in code (parse_config checks what it parses); returns it."""
    cfg.check()
    return cfg


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


def _resolve_key(key: str, recipe: str | None = None, notes: list[str] | None = None) -> tuple[str | None, str]:
    """(section or None, field) of `key` in `recipe`'s sections (None: all; see `config_keys.resolve`); the note
    of a peer's alias goes to `notes`."""
    dotted, note = config_keys.resolve(key, _all_keys(), recipe)
    if note and notes is not None and note not in notes:
        notes.append(note)
    return _all_keys()[dotted]


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
        if typ is str:  # a YAML true/false given to a string choice reads as "true"/"false"
            return "" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
    except (TypeError, ValueError, OverflowError) as exc:
        expected = getattr(typ, "__name__", typ)
        raise ConfigError(f"bad value {value!r} for '{key}' (expected {expected}): {exc}") from None
    return value


def set_value(cfg: Config, key: str, value: Any, recipe: str | None = None, notes: list[str] | None = None) -> None:
    section, name = _resolve_key(key, recipe, notes)
    target = getattr(cfg, section) if section else cfg
    typ = _field_types(type(target))[name]
    if value is None and typ is bool:  # a bare flag
        value = "true"
    elif value is None:
        raise ConfigError(f"--{key} needs a value")
    setattr(target, name, _coerce(value, typ, key))


def apply_mapping(cfg: Config, mapping: dict, prefix: str = "", recipe: str | None = None,
                  notes: list[str] | None = None) -> list[str]:
    """Apply a nested dict (from YAML/JSON): sections as sub-dicts, or dotted/bare keys at top level; a sub-dict
    of another name reads as dotted keys (verl's `actor_rollout_ref: {rollout: {n: 8}}`). Returns the dotted keys
    it set."""
    applied = []
    for key, value in mapping.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            applied += apply_mapping(cfg, value, f"{full}.", recipe, notes)
            continue
        section, name = _resolve_key(full, recipe, notes)
        set_value(cfg, f"{section}.{name}" if section else name, "" if value is None else value)
        applied.append(f"{section}.{name}" if section else name)
    return applied


def _split_overrides(argv: list[str]) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(config_keys.positional_hint(arg))
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


def parse_config(argv: list[str], defaults: dict | None = None, recipe: str | None = None,
                 settings: dict | None = None) -> Config:
    """Build a Config from entry-point defaults, `settings` (a mapping read as a --config file's, given in Python),
    optional --config files and --key value overrides; `given` holds the keys the mapping, the files and the
    overrides set. `recipe` (a `config_keys.RECIPES` name) accepts only the sections its trainer reads; a peer
    trainer's name for a setting prints one `note:` line on stderr (rank 0)."""
    cfg, notes = Config(), []
    apply_mapping(cfg, defaults or {})
    pairs = _split_overrides(argv)
    given: list[str] = apply_mapping(cfg, settings, recipe=recipe, notes=notes) if settings else []
    for key, value in pairs:
        if key == "config":
            if value is None:
                raise ConfigError("--config needs a file path")
            try:
                given += apply_mapping(cfg, load_file(value), recipe=recipe, notes=notes)
            except ConfigError as exc:
                raise ConfigError(f"{value}: {exc}" if not str(exc).startswith(("config file", value)) else exc) \
                    from None
    for key, value in pairs:
        if key == "config":
            continue
        section, name = _resolve_key(key, recipe, notes)
        given.append(f"{section}.{name}" if section else name)
        set_value(cfg, given[-1], value)
    cfg.check()
    cfg.given = frozenset(given)
    check_file_precedence(cfg, recipe)
    if notes and os.environ.get("RANK", "0") == "0":
        print("\n".join(notes), file=sys.stderr, flush=True)
    return cfg


def _field_comments(cls) -> dict[str, str]:
    """Each field's comment in the class source: the `# comment` after it, else the `#` lines right above it (a
    comment too long for the field's line). The schema documents itself once."""
    import inspect
    import re

    found, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        field = re.match(r"^\s+(\w+): [^=]+=.*?(?:#\s*(.+))?$", line)
        if field and (field[2] or above):
            found[field[1]] = field[2] or " ".join(above)
        above = []
    return found


def _choice_lines(rule: dict) -> list[str]:
    """--help lines for a registry-backed choice: every registered name with its one-line doc."""
    if not isinstance(rule.get("choices"), str):
        return []

    choices_of(rule)  # imports the built-in entries
    return [f"      {line}" for line in ALL[rule["choices"]].describe()]


def help_text(cfg: Config | None = None, recipe: str | None = None) -> str:
    """Every key `recipe` reads (None: every key) with its default (or current value) and its comment, grouped by
    section, then the peer trainers' names it reads as its own, for --help."""
    cfg = cfg or Config()
    lines = []
    top, shown = _field_comments(Config), config_keys.sections_of(recipe, SECTIONS)
    for name, typ in _field_types(Config).items():
        if dataclasses.is_dataclass(typ) and name in shown:
            lines.append(f"[{name}]")
            notes, rules = _field_comments(typ), _field_rules(typ)
            for sub, value in dataclasses.asdict(getattr(cfg, name)).items():
                note = f"  # {notes[sub]}" if sub in notes else ""
                lines.append(f"  --{name}.{sub} {value!r}{note}")
                lines.extend(_choice_lines(rules.get(sub, {})))
        elif not dataclasses.is_dataclass(typ):
            note = f"  # {top[name]}" if name in top else ""
            lines.append(f"--{name} {getattr(cfg, name)!r}{note}")
    if recipe is not None:
        lines.append("[names of peer trainers read as these settings]")
        lines += [f"  --{key} ({peer.source}) = --{peer.alias}" for key, peer in config_peers.aliases(recipe)
                  if peer.alias.split(".")[0] in shown]
    if "reward" in shown:
        lines.append("(rl.<name> spellings: --rl.reward_fn, --rl.eval_k, --rl.environment, ... read as the reward, "
                     "critic, eval and env keys with a note; the table: ds_rlhf/config_rl_names.py)")
    return "\n".join(lines)
