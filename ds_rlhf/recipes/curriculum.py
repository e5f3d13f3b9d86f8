"""The RL step's curriculum by difficulty (`rl.curriculum pass_rate`): `CurriculumStream` stands between the prompt
loader and the rollout service (`RLParts.loader_iter`). Each draw hands out the loader's next
`rl.prompts_per_step` prompts that `algos/curriculum.py:PassRateTracker` does not skip; a skipped prompt is replaced
by the next one in the loader's stream (its order otherwise unchanged; rows read but not yet handed out wait in a
buffer). `observe` records each scored group (before dynamic sampling drops any); `metrics` gives
`curriculum/skipped` (prompts skipped by the step's draws), `curriculum/tracked` and the pass-rate histogram
`curriculum/pass_rate_hist/<bin>`. Its state (tracker, buffer, draw count) is saved with the checkpoint, so a
resumed run draws the prompts an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from ds_rlhf.algos.curriculum import PassRateTracker
from ds_rlhf.recipes.trajectory import ScoredBatch
from ds_rlhf.rollout.service import plain_row


def prompt_key(row: dict) -> str:
    """A prompt's id: the hash of its prompt tokens (stable across epochs, resumes and row order)."""
    ids = row.get("input_ids", row.get("prompt_ids"))
    return hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


class CurriculumStream:
    def __init__(self, rows: Iterator[list[dict]], tracker: PassRateTracker, batch_size: int, scan_limit: int):
        self.rows, self.tracker, self.batch_size = rows, tracker, batch_size
        self.scan_limit = max(scan_limit, batch_size)  # a draw that skipped this many rows takes the next ones anyway
        self.buffer: list[dict] = []
        self.draws, self.step_skipped = 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        out, skipped = [], 0
        while len(out) < self.batch_size:
            if not self.buffer:
                self.buffer = list(next(self.rows))
            row = self.buffer.pop(0)
            if skipped < self.scan_limit and self.tracker.skipped(prompt_key(row), self.draws):
                skipped += 1
                continue
            out.append(row)
        self.draws += 1
        self.step_skipped += skipped
        return out

    def observe(self, scored: ScoredBatch) -> None:
        """Record each prompt's group of raw rewards in `scored` (every sample the reward stage kept)."""
        groups: dict[int, list[float]] = {}
        for sample, raw in zip(scored.samples, scored.raw()):
            groups.setdefault(sample.prompt_index, []).append(float(raw))
        for index, rewards in groups.items():
            self.tracker.observe(prompt_key(scored.rollout.rows[index]), rewards, self.draws)

    def metrics(self) -> dict[str, float]:
        """The step's curriculum metrics; resets the skipped count."""
        out = {"curriculum/skipped": float(self.step_skipped), "curriculum/tracked": float(len(self.tracker.records))}
        out.update({f"curriculum/pass_rate_hist/{b}": float(n) for b, n in self.tracker.histogram().items()})
        self.step_skipped = 0
        return out

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "buffer": [plain_row(r) for r in self.buffer],
                "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.tracker.load_state_dict(state.get("tracker", {}))
        self.buffer = list(state.get("buffer", []))
        self.draws, self.step_skipped = int(state.get("draws", 0)), 0
