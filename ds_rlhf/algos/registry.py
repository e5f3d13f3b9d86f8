"""One registry per kind of algorithmic choice: name -> function, one-line doc, and a few facts about it.

The config schema takes its allowed values (and `--help` its descriptions) from these registries, and the trainer
dispatches through them, so adding an estimator is one function, one decorator and its test:

    @ADVANTAGE_ESTIMATORS.register("my_adv", "what it does, and the paper", groups=True)
    def my_adv(*, scores, mask, group_ids=None): ...

after which `--rl.algo my_adv` is a valid choice and shows in `--help`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    doc: str
    meta: dict = field(default_factory=dict)


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, doc: str, *, aliases: tuple[str, ...] = (), **meta) -> Callable:
        """Decorator: register `fn` under `name` (and `aliases`). Re-registering a name is an error."""

        def wrap(fn: Callable) -> Callable:
            for key in (name, *aliases):
                if key in self._entries or key in self._aliases:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
            self._entries[name] = Entry(name, fn, doc, dict(meta))
            self._aliases.update({alias: name for alias in aliases})
            return fn

        return wrap

    def unregister(self, name: str) -> None:
        """Remove `name` and its aliases (tests that register throw-away entries clean up with this)."""
        self._entries.pop(name, None)
        self._aliases = {a: n for a, n in self._aliases.items() if n != name}

    def names(self, with_aliases: bool = True) -> tuple[str, ...]:
        return tuple(self._entries) + (tuple(self._aliases) if with_aliases else ())

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def get(self, name: str) -> Entry:
        key = self._aliases.get(name, name)
        if key not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}: choose one of {', '.join(self.names())}")
        return self._entries[key]

    def canonical(self, name: str) -> str:
        return self.get(name).name

    def describe(self) -> list[str]:
        """One line per entry: `name (aliases): doc`."""
        lines = []
        for entry in self._entries.values():
            aliases = [a for a, n in self._aliases.items() if n == entry.name]
            shown = entry.name + (f" (alias {', '.join(aliases)})" if aliases else "")
            lines.append(f"{shown}: {entry.doc}")
        return lines


ADVANTAGE_ESTIMATORS = Registry("rl.algo")
POLICY_LOSSES = Registry("rl.policy_loss")
KL_ESTIMATORS = Registry("rl.kl_estimator")
AGGREGATIONS = Registry("rl.loss_agg")
MISMATCH_MODES = Registry("rl.mismatch")
DPO_LOSSES = Registry("dpo.loss")

ALL = {"advantage": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES, "kl": KL_ESTIMATORS,
       "aggregation": AGGREGATIONS, "mismatch": MISMATCH_MODES, "dpo_loss": DPO_LOSSES}
