"""What each built engine is for: a small record per DeepSpeed engine (its role, resolved ds_config and whether it
trains), kept beside the engine in a weak side table instead of as attributes bolted onto DeepSpeed's object."""

from __future__ import annotations

import weakref
from dataclasses import dataclass


@dataclass(frozen=True)
class RoleInfo:
    role: str  # actor | critic | reference | reward | sft | rm
    ds_config: dict  # the resolved config the engine was built with
    trainable: bool


_ROLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_role(engine, info: RoleInfo) -> None:
    _ROLES[engine] = info


def role_info(engine) -> RoleInfo | None:
    """The record of an engine built by `engines.builder` (None for anything else, e.g. a plain module)."""
    try:
        return _ROLES.get(engine)
    except TypeError:  # not weak-referenceable: not one of ours
        return None
