"""The `--config` files: YAML or JSON, read strictly (a key given twice in one mapping, a malformed file or a
top level that is not a mapping is one `ConfigError` line), and the recipes shipped in the package found by their
`ds_configs/NAME` path from any directory."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ds_rlhf.errors import ConfigError


class _DuplicateKey(Exception):
    def __init__(self, key: str, where: str):
        super().__init__(key, where)
        self.key, self.where = key, where


def _yaml_loader():
    """yaml's SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(str(key), f"lines {seen[key]} and {line}")
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _unique_pairs(pairs: list) -> dict:
    """json.loads' object_pairs_hook refusing a key given twice in one object."""
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _DuplicateKey(key, f"{keys.count(key)} times in one object")
    return dict(pairs)


def _one_line_parse_error(exc: Exception) -> str:
    """A YAML/JSON parse error in one line: yaml's own text spans several (a context, a quoted excerpt, a caret)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def load_file(path: str | Path) -> dict:
    """A --config file (YAML or JSON) as a dict; ConfigError when it is missing, malformed, not a mapping, or gives
    one key twice in a mapping. `ds_configs/NAME` not found here is the recipe shipped in the package, so
    `--config ds_configs/dapo.yaml` works from any directory and from an installed wheel."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and path.parts[:1] == ("ds_configs",):
        packaged = Path(str(resources.files("ds_rlhf"))) / path  # a recipe shipped in the package
        path = packaged if packaged.is_file() else path
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    import yaml

    is_yaml = path.suffix in (".yaml", ".yml")
    try:
        data = (yaml.load(text, Loader=_yaml_loader()) or {}) if is_yaml else json.loads(
            text, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as dup:
        raise ConfigError(f"config file {path}: key '{dup.key}' is given twice ({dup.where}); keep one") from None
    except (ValueError, yaml.YAMLError) as exc:
        kind = "YAML" if is_yaml else "JSON"
        raise ConfigError(f"config file {path} is not valid {kind}: {_one_line_parse_error(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    return data
