"""Curriculum by difficulty (`rl.curriculum pass_rate`): `PassRateTracker`, each prompt's pass counts over the run
and the rule that skips a prompt every attempt so far passed or failed.

A prompt's group passes a sample when its raw reward >= `threshold`. After `min_attempts` groups whose samples all
passed (or all failed), the prompt is skipped for the next `skip_draws` prompt draws; when it comes up again after
that it is generated once more, and skipped again only while its record stays all-pass or all-fail. A prompt with
mixed results is always kept. Pure Python; `state_dict` / `load_state_dict` carry it through a checkpoint.
"""

from __future__ import annotations

HIST_BINS = ("0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0")


class PassRateTracker:
    def __init__(self, threshold: float, min_attempts: int, skip_draws: int):
        if min_attempts < 1 or skip_draws < 0:
            raise ValueError(f"min_attempts {min_attempts} must be >= 1 and skip_draws {skip_draws} >= 0")
        self.threshold, self.min_attempts, self.skip_draws = threshold, min_attempts, skip_draws
        self.records: dict[str, list[int]] = {}  # prompt id -> [groups, samples, passes, skipped until draw]

    def observe(self, key: str, rewards: list[float], draw: int) -> None:
        """One group of `key`'s samples scored after draw `draw` (the count of draws so far)."""
        if not rewards:
            return
        rec = self.records.setdefault(key, [0, 0, 0, 0])
        rec[0] += 1
        rec[1] += len(rewards)
        rec[2] += sum(r >= self.threshold for r in rewards)
        if rec[0] >= self.min_attempts and rec[2] in (0, rec[1]):
            rec[3] = draw + self.skip_draws

    def skipped(self, key: str, draw: int) -> bool:
        """Whether draw number `draw` leaves prompt `key` out."""
        rec = self.records.get(key)
        return rec is not None and draw < rec[3]

    def pass_rate(self, key: str) -> float | None:
        rec = self.records.get(key)
        return None if rec is None else rec[2] / rec[1]

    def histogram(self) -> dict[str, int]:
        """Tracked prompts per pass-rate bin (`HIST_BINS`; 1.0 falls in the last)."""
        counts = [0] * len(HIST_BINS)
        for _, samples, passes, _ in self.records.values():
            counts[min(int(passes / samples * len(HIST_BINS)), len(HIST_BINS) - 1)] += 1
        return dict(zip(HIST_BINS, counts))

    def state_dict(self) -> dict:
        return {"records": {k: list(v) for k, v in self.records.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.records = {k: [int(x) for x in v] for k, v in state.get("records", {}).items()}
