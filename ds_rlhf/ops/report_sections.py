"""Sections of the run report besides the plots: the health warnings, grouped, and the sample rollouts.

Health: `run.health.replay` gives one warning per step and kind while a condition lasts (a run of slow steps gives
one per slow step); the report shows each kind (and likely cause) once: how many steps raised it, the steps it
spans, and the last step's message.

Samples: `samples.jsonl` (RL with `run.sample_log_every N`) as a table of the first and the last logged step's
samples: prompt, response, the reward the update used and each reward function's score.

Curriculum: with `rl.curriculum pass_rate`, one line from the last step's `curriculum/...` metrics: prompts
tracked, skipped at that step, and the pass-rate histogram.
"""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass
from pathlib import Path

from ds_rlhf.telemetry.samples import cell_text, read_samples

MAX_CELL_CHARS = 600  # a prompt or response longer than this is cut in the table (samples.jsonl keeps it whole)
MAX_ROWS_PER_STEP = 8


@dataclass
class HealthGroup:
    kind: str
    cause: str
    count: int
    first_step: int
    last_step: int
    message: str  # the last occurrence's

    def line(self) -> str:
        steps = f"step {self.first_step}" if self.first_step == self.last_step else \
            f"steps {self.first_step}-{self.last_step}"
        times = "once" if self.count == 1 else f"{self.count} times"
        return f"{self.kind}: {times}, {steps}; last: {self.message}"


def group_health(found: list) -> list[HealthGroup]:
    """`run.health.HealthWarning`s grouped by (kind, cause), in the order each group first appeared."""
    groups: dict[tuple[str, str], HealthGroup] = {}
    for w in found:
        key = (w.kind, w.cause)
        group = groups.get(key)
        if group is None:
            groups[key] = HealthGroup(w.kind, w.cause, 1, w.step, w.step, w.message)
        else:
            group.count += 1
            group.first_step, group.last_step = min(group.first_step, w.step), max(group.last_step, w.step)
            group.message = w.message
    return list(groups.values())


def health_html(found: list) -> str:
    groups = group_health(found)
    if not groups:
        return "<p>no health warnings</p>"
    return ("<ul class='health'>" + "".join(f"<li>{html.escape(g.line())}</li>" for g in groups) + "</ul>"
            f"<p>{len(found)} warning(s) over the run in {len(groups)} group(s)</p>")


def _cell(value) -> str:
    return html.escape(cell_text(value, MAX_CELL_CHARS))


def shown_samples(records: list[dict]) -> list[dict]:
    """The first and the last logged step's samples (up to MAX_ROWS_PER_STEP each)."""
    steps = sorted({r.get("step") for r in records if isinstance(r.get("step"), int | float)})
    chosen = steps[:1] + steps[-1:] if len(steps) > 1 else steps
    return [r for step in chosen for r in [r for r in records if r.get("step") == step][:MAX_ROWS_PER_STEP]]


def samples_html(run_dir: Path) -> str:
    """The samples section ('' when the run logged none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line: the rows before it are shown
        try:
            records = read_samples(run_dir)
        except ValueError as exc:
            return f"<p class='warn'>{html.escape(str(exc))}</p>"
    if not records:
        return ""
    rows = "".join(f"<tr><td>{_cell(r.get('step'))}</td><td class='text'>{_cell(r.get('prompt'))}</td>"
                   f"<td class='text'>{_cell(r.get('response'))}</td><td>{_cell(r.get('reward'))}</td>"
                   f"<td>{_cell(r.get('reward_components'))}</td><td>{_cell(r.get('ground_truth'))}</td></tr>"
                   for r in shown_samples(records))
    steps = len({r.get("step") for r in records})
    return (f"<p>{len(records)} samples logged at {steps} step(s) (samples.jsonl); the first and the last step's "
            "here</p><table class='samples'><tr><th>step</th><th>prompt</th><th>response</th><th>reward</th>"
            f"<th>reward parts</th><th>ground truth</th></tr>{rows}</table>")


def curriculum_html(records: list[dict]) -> str:
    """The curriculum line ('' when no step logged `curriculum/tracked`)."""
    last = next((r for r in reversed(records) if "curriculum/tracked" in r), None)
    if last is None:
        return ""
    prefix = "curriculum/pass_rate_hist/"
    hist = ", ".join(f"{k[len(prefix):]}: {int(v)}" for k, v in last.items() if k.startswith(prefix))
    return (f"<p>curriculum at step {html.escape(str(last.get('step')))}: {int(last['curriculum/tracked'])} prompts "
            f"tracked, {int(last.get('curriculum/skipped', 0))} skipped in the step's draws; pass rates "
            f"{html.escape(hist)}</p>")
