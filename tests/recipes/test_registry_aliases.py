"""Every alias of every registry entry behaves exactly like its canonical name: the config stores the canonical
name (so every `==` in the trainer sees one spelling), and Dr.GRPO's aggregation divides by the generation budget
under each of its names."""

from __future__ import annotations

import dataclasses

from ds_rlhf.config import SECTIONS, Config, parse_config, registry_of
from ds_rlhf.recipes.policy_update import _agg_mode


def _registry_keys() -> dict[str, dict]:
    """`section.key` -> rule, for every setting whose choices come from a registry."""
    return {f"{section}.{f.name}": f.metadata["rule"] for section in SECTIONS
            for f in dataclasses.fields(getattr(Config(), section))
            if isinstance(f.metadata.get("rule", {}).get("choices"), str)}


def test_every_alias_is_stored_as_its_canonical_name_and_configures_the_same_run():
    keys = _registry_keys()
    assert {"rl.algo", "rl.loss_agg", "rl.policy_loss", "rl.kl_estimator", "rl.mismatch"} <= set(keys)
    aliases_seen = 0
    for key, rule in keys.items():
        registry = registry_of(rule)
        for name in registry.names():
            canonical = registry.canonical(name)
            via_alias = parse_config([f"--{key}", name])
            assert getattr(getattr(via_alias, key.split(".")[0]), key.split(".")[1]) == canonical, (key, name)
            assert via_alias.to_dict() == parse_config([f"--{key}", canonical]).to_dict(), (key, name)
            aliases_seen += name != canonical
    assert aliases_seen >= 2  # const-norm and dr_grpo at least


def test_dr_grpo_aggregation_divides_by_the_generation_budget_under_every_name():
    for name in ("seq-mean-token-sum-norm", "const-norm", "dr_grpo"):
        cfg = parse_config(["--rl.loss_agg", name, "--rollout.max_new_tokens", "96"])
        assert _agg_mode(cfg) == ("seq-mean-token-sum-norm", 96.0), name
