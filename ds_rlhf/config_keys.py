"""Which trainer reads which config sections, and what a key the user typed sets.

Each training command parses only the sections its trainer reads (`RECIPES`, found by what the recipes and their
run machinery read from the config), so a setting of another trainer is refused in one line naming the trainer that
reads it (`dpo.beta` in `train-ppo`). A key resolves, in order: our dotted name within the recipe's sections, the
`rl.<name>` spelling of a reward / critic / eval / env setting (`config_rl_names`: read as its section's key, with a
note), our bare name (a field's name, unique among the recipe's sections and not a section's name), a peer trainer's
name (`config_peers`: an alias, or a refusal with our setting of that meaning), a setting of another recipe
(refused, naming it), else unknown with the closest names of the recipe's own.
"""

from __future__ import annotations

import difflib

from ds_rlhf import config_peers, config_rl_names
from ds_rlhf.errors import ConfigError

# recipe (the command's name) -> the config sections its trainer reads; the top-level keys (ds_config, zero_stage,
# offload, local_rank) belong to every recipe
RECIPES: dict[str, tuple[str, ...]] = {
    "train-ppo": ("model", "data", "optim", "rollout", "rl", "reward", "critic", "eval", "env", "run"),
    "train-sft": ("model", "data", "optim", "run"),
    "train-rm": ("model", "data", "optim", "run"),
    "train-dpo": ("model", "data", "optim", "dpo", "run"),
}

Keys = dict[str, tuple[str | None, str]]  # dotted key -> (section or None, field)


def sections_of(recipe: str | None, all_sections: list[str]) -> list[str]:
    """The sections `recipe` reads, in schema order (None: every section)."""
    if recipe is None:
        return list(all_sections)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: one of {', '.join(RECIPES)}")
    return [s for s in all_sections if s in RECIPES[recipe]]


def readers(section: str) -> list[str]:
    """The recipes that read `section`."""
    return [recipe for recipe, sections in RECIPES.items() if section in sections]


def scoped(keys: Keys, recipe: str | None) -> Keys:
    """The keys of `keys` that `recipe` reads."""
    if recipe is None:
        return keys
    return {k: v for k, v in keys.items() if v[0] is None or v[0] in RECIPES[recipe]}


def _bare(key: str, keys: Keys) -> list[str]:
    return [k for k in keys if k.split(".")[-1] == key]


def _find(key: str, keys: Keys) -> str | None:
    """The dotted key `key` names in `keys` (itself, or the one key whose field it is); ConfigError when several."""
    if key in keys:
        return key
    bare = _bare(key, keys)
    if bare and key in {section for section, _ in keys.values()}:
        shown = ", ".join(f"--{k}" for k in [k for k in keys if k.startswith(f"{key}.")][:3])
        raise ConfigError(f"--{key} names the [{key}] section: give one of its keys ({shown}, ...), or the dotted "
                          f"key of the field: {' or '.join('--' + b for b in bare)}")
    if len(bare) > 1:
        raise ConfigError(f"ambiguous config key '{key}': use one of {', '.join(sorted(bare))}")
    return bare[0] if bare else None


def not_read(dotted: str, recipe: str, typed: str | None = None) -> ConfigError:
    """`dotted` is a setting of other trainers: the error naming them (`typed`: the peer name the user gave)."""
    names = " or ".join(readers(dotted.split(".")[0])) or "no trainer"
    said = f"--{typed} reads as {dotted}, " if typed else f"{dotted} is "
    return ConfigError(f"{said}a setting of {names}; {recipe} does not read it")


def did_you_mean(key: str, keys: Keys) -> str:
    """' (did you mean 'a' or 'b'?)' with the closest distinct names of `keys`, or ''."""
    names = list(dict.fromkeys([*keys, *sorted({k.split(".")[-1] for k in keys})]))
    close = difflib.get_close_matches(key, names, n=3)
    close = [c for c in close if not any(c != o and o.endswith("." + c) for o in close)]  # 'x.y' over its bare 'y'
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def resolve(key: str, keys: Keys, recipe: str | None) -> tuple[str, str | None]:
    """(the dotted key `key` sets, a note line when it is a peer's alias) for `recipe` (None: every section);
    ConfigError when it is ambiguous, another trainer's, a peer name without an alias here, or unknown."""
    key = key.replace("-", "_")
    mine = scoped(keys, recipe)
    if key in mine:
        return key, None
    spelled = config_rl_names.lookup(key)
    if spelled is not None and (key == spelled[0] or _bare(key, mine) != [spelled[1]]):
        if spelled[1] not in mine:
            raise not_read(spelled[1], recipe or "", typed=key)
        return spelled[1], config_rl_names.note_line(key, spelled[1])
    found = _find(key, mine)
    if found:
        return found, None
    peer = config_peers.lookup(key, recipe)
    if peer is not None and peer.alias:
        if peer.alias not in mine:
            raise not_read(peer.alias, recipe or "", typed=key)
        return peer.alias, f"note: --{key} read as --{peer.alias}"
    if peer is not None:
        raise ConfigError(config_peers.hint_line(key, peer))
    if recipe is not None:
        elsewhere = [k for k in ([key] if key in keys else _bare(key, keys)) if k not in mine]
        if elsewhere:
            raise not_read(elsewhere[0], recipe)
    raise ConfigError(f"unknown config key '{key}'{did_you_mean(key, mine)}; see --help for the list")


def positional_hint(arg: str) -> str:
    """The error line of an argument without `--`: a Hydra-style `a.b=value` (verl) names the setting to give."""
    key, _, value = arg.partition("=")
    peer = config_peers.lookup(key, None) if value else None
    if peer is not None:
        ours = f"--{peer.alias} {value}" if peer.alias else peer.hint
        return f"unexpected argument '{arg}': settings are given as --key value; {peer.source}'s {key} is {ours}"
    return f"unexpected argument '{arg}': settings are given as --key value"


def recipe_view(mapping: dict, recipe: str) -> dict:
    """A --config mapping without the sections `recipe` does not read (a recipe file shared by several commands,
    e.g. SFT -> RM -> PPO under one memory cap, as each command's own file)."""
    others = {s for sections in RECIPES.values() for s in sections} - set(RECIPES[recipe])
    return {k: v for k, v in mapping.items() if k.split(".")[0] not in others}
