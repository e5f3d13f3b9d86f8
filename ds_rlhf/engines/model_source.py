"""Where a model or tokenizer comes from: one function turns what a user typed into a local directory.

Accepted specs (`--model.path`, `--model.tokenizer`, `--reward.model`, `--critic.path`, prep's `--tokenizer`):

- a local directory (a Hugging Face model directory with config.json, or a peft adapter directory);
- a Hugging Face Hub id, `org/name` or `org/name@revision` (a branch, tag or commit), read through
  `huggingface_hub.snapshot_download` from the standard cache (HF_HOME / HF_HUB_CACHE). A cached snapshot that holds
  what is asked for (a model's config and weights, or a tokenizer's files) is used without any network call, online
  or not; otherwise it downloads only when downloads are allowed (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset), and
  offline a model that is not cached is one `ConfigError` naming the id and how to fetch it beforehand;
- `tiny` / `tiny:<preset>`: the offline tiny model of `engines/tiny_models.py`, built on first use;
- a `.gguf` file: converted once into the cache (`_gguf_model_dir`) and read from there.

A spec that looks like a path (starts with `/`, `.` or `~`, or exists) is always taken as one. Hub resolutions are
remembered per process, so every role of a run (and every later call) gets the same snapshot directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ds_rlhf.engines.gguf_import import cached_conversion
from ds_rlhf.engines.tiny_models import PRESETS, build_tiny_model, default_cache_dir
from ds_rlhf.errors import ConfigError

# huggingface_hub's repo id rules (validate_repo_id): `org/name`, letters, digits, `-`, `_`, `.`; an optional
# `@revision` (branch, tag or commit; branch names may hold `/`).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]+))?$")
# What a tokenizer needs from a Hub repo; a tokenizer-only resolution downloads these, not the weights.
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
MODEL_MARKERS = ("config.json", "adapter_config.json")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_RESOLVED: dict[tuple, str] = {}


class ModelSourceError(ConfigError, FileNotFoundError):
    """A model or tokenizer spec that gives no usable local directory (one line naming the setting and the fix).
    Also a FileNotFoundError, so callers that report a missing model directory report this too."""


def hub_offline() -> bool:
    """Whether Hub downloads are off: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set to a true value (read now, and as
    huggingface_hub read it at import)."""
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return constants.HF_HUB_OFFLINE or env in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The Hugging Face Hub cache that `snapshot_download` reads (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def looks_local(spec: str) -> bool:
    """A spec that names a path rather than a Hub id: starts with `/`, `.` or `~`, or exists on disk."""
    return spec.startswith(("/", ".", "~")) or Path(spec).exists()


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) for `org/name[@revision]`; None when `spec` is not of that form."""
    match = HUB_ID.match(spec)
    return (match["repo"], match["revision"]) if match else None


def resolve_model_source(spec: str, key: str = "model.path", what: str = "model") -> str:
    """The local directory for `spec` (see the module docstring). `key` names the setting in error messages;
    `what` is "model" (the directory must hold config.json or adapter_config.json) or "tokenizer" (a Hub repo
    downloads only its tokenizer files). Every user error is one `ModelSourceError` (a `ConfigError`) line."""
    spec = str(spec).strip()
    if not spec:
        raise ModelSourceError(f"{key} is empty: pass a local model directory or a Hugging Face Hub id (org/name)")
    if spec == "tiny" or spec.startswith("tiny:"):
        preset = spec.partition(":")[2] or "tiny"
        if preset not in PRESETS:
            raise ModelSourceError(f"{key}={spec!r}: no tiny preset {preset!r} (have {', '.join(sorted(PRESETS))})")
        return str(build_tiny_model(spec=preset))
    if spec.endswith(".gguf") and Path(spec).expanduser().is_file():
        return _gguf_model_dir(Path(spec).expanduser(), key)
    if looks_local(spec):
        return _local_dir(spec, key, what)
    hub = parse_hub_id(spec)
    if hub is None:
        raise ModelSourceError(f"{key}={spec!r} is neither a local directory nor a Hugging Face Hub id (org/name or "
                               "org/name@revision)")
    return _hub_snapshot(spec, hub[0], hub[1], key, what)


def _local_dir(spec: str, key: str, what: str) -> str:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelSourceError(f"{key}={spec!r}: no such directory (pass a local {what} directory or a Hugging "
                               "Face Hub id, org/name)")
    if not path.is_dir():
        raise ModelSourceError(f"{key}={spec!r} is a file, not a {what} directory (pass the directory that holds "
                               "config.json and the weights)")
    if what == "model" and not any((path / marker).is_file() for marker in MODEL_MARKERS):
        raise ModelSourceError(f"{key}={spec!r} is not a model directory: it has no config.json (nor a peft "
                               "adapter_config.json)")
    return str(path)


def _hub_snapshot(spec: str, repo_id: str, revision: str | None, key: str, what: str) -> str:
    """`snapshot_download` of the repo (cache only when offline), remembered per (spec, what, cache, offline)."""
    offline = hub_offline()
    memo = (spec, what, hub_cache_dir(), offline)
    if memo in _RESOLVED:
        return _RESOLVED[memo]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    where = f"{key}={spec!r}"
    patterns = TOKENIZER_FILES if what == "tokenizer" else None
    try:
        path = _cached_snapshot(repo_id, revision, patterns, what)
        if path is None:
            path = snapshot_download(repo_id, revision=revision, local_files_only=offline, allow_patterns=patterns)
    except GatedRepoError:
        why = (f"the Hub repo {repo_id} is gated: accept its terms on the Hub and log in (`hf auth login`) or set "
               "HF_TOKEN")
    except RepositoryNotFoundError:
        why = (f"no Hub repo {repo_id} (or it is private: `hf auth login` or set HF_TOKEN), and no local directory "
               "of that name")
    except RevisionNotFoundError:
        why = f"the Hub repo {repo_id} has no revision {revision!r}"
    except IncompleteSnapshotError:
        why = (f"the cached snapshot of {repo_id} in {hub_cache_dir()} is incomplete: complete it with `{fetch}` on a "
               "machine with network")
    except LocalEntryNotFoundError:
        off = "downloads are off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)" if offline else "the Hub could not be reached"
        why = (f"{repo_id} is not a local directory and not in the Hugging Face cache {hub_cache_dir()}, and {off}: "
               f"fetch it beforehand with `{fetch}` on a machine with network (same HF_HOME), or point HF_HUB_CACHE "
               "at a cache that has it")
    except (HfHubHTTPError, OSError, ValueError) as exc:
        why = f"cannot get {repo_id} from the Hub: {' '.join(str(exc).split())}"
    else:
        if what == "model" and not any((Path(path) / marker).is_file() for marker in MODEL_MARKERS):
            raise ModelSourceError(f"{where}: the Hub repo {repo_id} has no config.json, so it is not a transformers "
                                   f"model (snapshot {path})")
        _RESOLVED[memo] = path
        return path
    raise ModelSourceError(f"{where}: {why}")


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str] | None, what: str) -> str | None:
    """The cached snapshot of the repo when it holds what `what` needs (a tokenizer's files; a model's config and
    weights), found with no network call; None when there is none (or only part of it, e.g. the tokenizer files of
    a model whose weights were never fetched)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns))
    except (LocalEntryNotFoundError, IncompleteSnapshotError, OSError, ValueError):
        return None
    if what == "tokenizer":
        whole = any((path / name).is_file() for name in TOKENIZER_MARKERS)
    else:
        whole = (path / "adapter_config.json").is_file() or (
            (path / "config.json").is_file() and any(any(path.glob(glob)) for glob in WEIGHT_FILES))
    return str(path) if whole else None


# -- GGUF ---------------------------------------------------------------------------------------------------------
def _gguf_model_dir(path: Path, key: str) -> str:
    """A `.gguf` file as a model directory: converted once (bf16) into `$DS_RLHF_CACHE/gguf/`, keyed by the file's
    sha256, by `engines/gguf_import.py` (which fixes the special tokens up from the chat template), and reused."""
    return str(cached_conversion(path, default_cache_dir() / "gguf", "bf16"))


def resolve_model_path(spec: str, key: str = "model.path") -> str:
    """The local directory of a model spec: a local HF directory, a Hub id (`org/name[@revision]`, from the HF
    cache; downloaded only when online), or `tiny` / `tiny:<preset>`. `key` names the
    setting in the one-line `ConfigError` a bad spec raises."""
    return resolve_model_source(spec, key)
