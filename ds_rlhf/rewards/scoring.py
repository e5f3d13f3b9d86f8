"""Scoring a batch: weighted sum of the reward functions, per-function scores, and the bad-reward policy.

A sample is bad when any of its functions raised (any BaseException from user code, SystemExit included), hung
past the pool's timeout, or returned something that is not a real number finite in float32 (NaN, inf, 1e300,
None). A bad sample is never averaged in silently: it is reported with its id and reason, then the declared policy
applies — `fail` stops the run, `zero` scores it 0, `drop` removes it from the update. A bool or a string is no
reward under any policy: the function is wrong, and the run stops with one line naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ds_rlhf.rewards.calling import F32_MAX, BadRewardError, BadValue, Outcome, Refused
from ds_rlhf.rewards.reward_set import RewardSet, RewardSpec

POLICIES = ("fail", "zero", "drop")


@dataclass
class RewardReport:
    """Scores for a batch plus which samples were bad and why.

    scores: weighted sum per sample (0.0 for a bad one); keep: False for a sample dropped by the `drop` policy;
    bad: one (sample id, reason) per bad sample; components: each function's own score per sample (None where
    bad); extras: `<function>/<metric>` per sample from dict returns (None where absent).
    """

    scores: list[float]
    keep: list[bool]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (sample id, reason)
    components: dict[str, list[float | None]] = field(default_factory=dict)
    extras: dict[str, list[float | None]] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def all_bad(self) -> bool:
        """Every sample of a non-empty batch was bad: nothing to learn from, the caller should stop the run."""
        return bool(self.scores) and len(self.bad) == len(self.scores)

    def means(self, prefix: str = "reward/", extras_only: bool = False) -> dict[str, float]:
        """`<prefix><function>` and `<prefix><function>/<metric>` means over kept samples with a value (only the
        latter with `extras_only`), and the `<prefix><function>/<kind>` counts of bad items."""
        out = {prefix + name: count for name, count in self.counts.items()}
        for name, values in {**({} if extras_only else self.components), **self.extras}.items():
            kept = [v for v, k in zip(values, self.keep) if k and v is not None]
            if kept:
                out[prefix + name] = sum(kept) / len(kept)
        return out


def _combine(rewards: RewardSet, per_member: list[list[Outcome]], items: list[dict], on_bad: str) -> RewardReport:
    n, single = len(items), len(rewards.specs) == 1
    report = RewardReport([], [], components={name: [None] * n for name in rewards.names})
    report.counts = {f"{spec.name}/{kind}": 0.0 for spec in rewards.specs
                     for kind in getattr(spec.source, "bad_kinds", ())}
    for i, item in enumerate(items):
        total, reasons = 0.0, []
        for spec, outcomes in zip(rewards.specs, per_member):
            outcome = outcomes[i]
            if isinstance(outcome, Refused):  # a bool or a string: the function is wrong, whatever the policy
                raise BadRewardError(f"reward function {spec.name} {outcome} (sample {item['id']})")
            if isinstance(outcome, BadValue):
                key = f"{spec.name}/{outcome.kind}"
                report.counts[key] = report.counts.get(key, 0.0) + 1
            if isinstance(outcome, str):
                reasons.append(outcome if single else f"{spec.name} {outcome}")
                continue
            score, extras = outcome
            report.components[spec.name][i] = score
            total += spec.weight * score
            for key, value in extras.items():
                report.extras.setdefault(f"{spec.name}/{key}", [None] * n)[i] = value
        if not reasons and not (math.isfinite(total) and abs(total) <= F32_MAX):
            reasons.append(f"weighted sum {total:g} is not finite in float32")
        if reasons:
            report.bad.append((str(item["id"]), "; ".join(reasons)))
        report.scores.append(0.0 if reasons else total)
        report.keep.append(not reasons or on_bad != "drop")
    return report


def score_samples(fn: Callable | RewardSet, items: list[dict], on_bad: str) -> RewardReport:
    """Apply `fn` (a reward function of any supported style, or a RewardSet) to items with keys prompt, response,
    ground_truth, metadata, id; enforce the bad-reward policy (`fail` raises BadRewardError listing sample ids)."""
    if on_bad not in POLICIES:
        raise ValueError(f"on_bad_reward must be fail, zero or drop, got '{on_bad}'")
    rewards = fn if isinstance(fn, RewardSet) else RewardSet([RewardSpec(fn)])
    report = _combine(rewards, rewards.evaluate(items), items, on_bad)
    if report.bad and on_bad == "fail":
        listed = "; ".join(f"{sid}: {why}" for sid, why in report.bad[:5])
        raise BadRewardError(f"{len(report.bad)} bad reward(s) (policy 'fail'): {listed}"
                             + (" ..." if len(report.bad) > 5 else ""))
    return report
