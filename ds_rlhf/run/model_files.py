"""What the run's model directories say before any model loads: the local directory of `model.path` (a Hub id
resolved to its cached snapshot, `engines/model_source.py`; None for `tiny` models, which set-up builds), a model's
settings from its config.json and the longest sequence it takes. The preflight checks (`preflight.py`,
`preflight_memory.py`) read them."""

from __future__ import annotations

import json
from pathlib import Path

from ds_rlhf.config import Config
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.errors import ConfigError


def is_tiny(spec: str) -> bool:
    """A `tiny` model spec (built at set-up, no directory to read)."""
    return spec == "tiny" or spec.startswith("tiny:")


def model_dir(cfg: Config) -> str | None:
    """The local directory of `model.path` (a Hub id resolved to its snapshot); None for `tiny` models, which
    set-up builds."""
    return None if is_tiny(cfg.model.path) else resolve_model_source(cfg.model.path, "model.path")


def model_config(local_dir: str) -> dict | None:
    """The text model's settings from `local_dir`'s config.json (a multimodal config's `text_config`); None when
    there is no config.json (a peft adapter directory)."""
    path = Path(local_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable model config ({exc})") from None
    return config.get("text_config") or config


# config.json keys that give a model's context, as vLLM reads them (the smallest one present is the limit)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")


def model_context(local_dir: str) -> tuple[str, int] | None:
    """(config key, tokens): the longest sequence the model in `local_dir` takes, from its config.json (a
    multimodal config's `text_config`). None when config.json is absent (a peft adapter directory), names no
    context, or sets `rope_scaling` (a stretched context: vLLM derives it from the scaling)."""
    config = model_config(local_dir)
    if config is None or config.get("rope_scaling"):
        return None
    found = [(key, config[key]) for key in CONTEXT_KEYS if isinstance(config.get(key), int) and config[key] > 0]
    return min(found, key=lambda kv: kv[1]) if found else None
