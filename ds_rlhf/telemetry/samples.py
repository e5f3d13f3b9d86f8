"""SampleLogger: a few rollouts every N steps, as text, beside the metrics: JSONL always, TensorBoard, wandb.

Rank 0 only. `samples.jsonl` in the run directory gets one JSON object per sample, `{"step": ..., **row}`, flushed
after each step's rows (a torn last line from a crash is cut before the next append, as for `metrics.jsonl`;
`truncate_samples` drops the records after a resumed checkpoint's step). TensorBoard gets one markdown table per
step under the text tag `samples`, wandb a `wandb.Table` under `samples`; both come from the MetricsLogger's own
writer and run (pass them in), so wandb's offline mode and "never crash the run" hold here too.

A row is a dict with these keys (the caller builds them; more keys are kept in the JSONL, not in the tables):

    prompt             str    the prompt text
    response           str    the decoded response
    reward             float  the sequence reward the update used
    reward_components  dict   each reward function's own score ({name: float | None}; {} for a reward model)
    ground_truth       str | None
    advantage          float  the sample's advantage (e.g. its first response token's, or the sequence's)
    weights_version    int    trainer steps applied to the weights that generated it

and may carry `prompt_index` (int: the prompt's position in the step's batch, i.e. its group of samples); the
logger then adds `group` = "<step>/<prompt_index>", one id per prompt and step, so the samples of one group can be
collected and compared (e.g. their rewards, which decide the group-relative advantages).

A multi-turn episode's row (`env.name`) also carries `episode_fields`: `turns`, its whole response as a list
of `{"role": "assistant" | "tool", "text": ...}`, one per run of generated (loss mask 1: assistant) or observation
(loss mask 0: tool) tokens, each decoded from its token ids with special tokens kept, so the texts joined are the
response exactly as the model read and wrote it (a tool turn holds the chat template's framing around the tool's
result); `tool_calls` (turns that called a tool), `truncated` (a budget ended the episode), `episode_end`
(`done`, `max_turns`, `max_total_tokens`, or `error` / `timeout` / `oversized` when the environment failed it),
`episode_reward` (the environment's reward, the sum of `turn_rewards`: each environment step's reward, in order)
and `episode_reports` (what went wrong: tool errors and timeouts, truncated output, malformed calls, an
environment that raised, hung or flooded; one dict each with its turn and status).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from ds_rlhf.telemetry.logger import cut_torn_tail, parse_lines, rewrite_lines

SAMPLES_FILE = "samples.jsonl"
ROW_KEYS = ("prompt", "response", "reward", "reward_components", "ground_truth", "advantage", "weights_version")
GROUP_KEY, PROMPT_INDEX_KEY = "group", "prompt_index"
TABLE_COLUMNS = ("step", *ROW_KEYS, GROUP_KEY)


def _plain(value):
    """JSON-safe: tensors/numpy scalars to Python, non-finite floats to strings (as metrics.jsonl does)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def cell_text(value, max_chars: int) -> str:
    """A sample field as one table cell's plain text: dicts as `k=v` pairs, floats to 4 digits, at most
    `max_chars` characters (then how many more there were)."""
    if isinstance(value, dict):
        value = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    elif isinstance(value, float):
        value = f"{value:.4g}"
    text = "" if value is None else str(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... ({len(text) - max_chars} more chars)"
    return text


def _cell(value, max_chars: int) -> str:
    text = cell_text(value, max_chars)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def episode_transcript(response_ids, loss_mask, tokenizer) -> list[dict]:
    """An episode's response as turns: each maximal run of equal `loss_mask` values is one turn, "assistant" where
    the mask is 1 (generated), "tool" where it is 0 (observation), its text `tokenizer.decode`d with special tokens
    kept."""
    turns: list[dict] = []
    start = 0
    for end in range(1, len(response_ids) + 1):
        if end == len(response_ids) or loss_mask[end] != loss_mask[start]:
            turns.append({"role": "assistant" if loss_mask[start] else "tool",
                          "text": tokenizer.decode(list(response_ids[start:end]), skip_special_tokens=False)})
            start = end
    return turns


def episode_fields(response_ids, loss_mask, episode: dict, tokenizer) -> dict:
    """The sample-log fields of a multi-turn episode (module docstring) from its response ids, loss mask and
    `RolloutSample.episode` record."""
    return {"turns": episode_transcript(response_ids, loss_mask, tokenizer), "tool_calls": int(episode["tool_turns"]),
            "truncated": bool(episode["truncated"]), "episode_end": episode["end"],
            "episode_reward": float(episode["reward"]),
            "turn_rewards": [float(r) for r in episode.get("turn_rewards", [])],
            "episode_reports": list(episode.get("reports", []))}


def markdown_table(step: int, records: list[dict], max_chars: int = 2000) -> str:
    """The records as a markdown table, one row per sample (TensorBoard renders it)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for rec in records:
        lines.append("| " + " | ".join(_cell(rec.get(c), max_chars) for c in TABLE_COLUMNS) + " |")
    return "\n".join(lines)


class SampleLogger:
    """`maybe_log(step, rows)` logs the first `k` rows every `every` steps (`every=0`: never)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, every: int, k: int, tensorboard_writer=None,
                 wandb_run=None, max_chars: int = 2000):
        if every < 0 or k < 0:
            raise ValueError(f"every and k must be >= 0, got every={every}, k={k}")
        self.every, self.k, self.max_chars = int(every), int(k), int(max_chars)
        self.active = rank == 0 and self.every > 0 and self.k > 0
        self.path = Path(run_dir) / SAMPLES_FILE
        self._tb, self._wandb, self._file = tensorboard_writer, wandb_run, None
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            cut_torn_tail(self.path)
            self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())

    def due(self, step: int) -> bool:
        """Whether `maybe_log(step, ...)` would write: lets the caller skip building rows on other steps."""
        return self.active and step % self.every == 0

    def maybe_log(self, step: int, rows: list[dict]) -> int:
        """Write the first `k` of `rows` when `step` is a multiple of `every` (rank 0); returns how many."""
        if not self.due(step) or not rows:
            return 0
        records = []
        for row in rows[: self.k]:
            missing = [key for key in ROW_KEYS if key not in row]
            if missing:
                raise ValueError(f"sample row lacks {missing} (a row needs {list(ROW_KEYS)})")
            record = {"step": step, **{str(k): _plain(v) for k, v in row.items()}}
            if isinstance(record.get(PROMPT_INDEX_KEY), int):
                record[GROUP_KEY] = f"{step}/{record[PROMPT_INDEX_KEY]}"
            records.append(record)
        self._file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self._file.flush()
        if self._tb is not None:
            self._tb.add_text("samples", markdown_table(step, records, self.max_chars), step)
        if self._wandb is not None:
            self._log_wandb(step, records)
        return len(records)

    def _log_wandb(self, step: int, records: list[dict]) -> None:
        try:
            import wandb

            data = [[json.dumps(r[c], ensure_ascii=False) if isinstance(r.get(c), dict) else r.get(c)
                     for c in TABLE_COLUMNS] for r in records]
            self._wandb.log({"samples": wandb.Table(columns=list(TABLE_COLUMNS), data=data)}, step=step)
        except Exception as exc:  # a sample table never stops a run
            print(f"[telemetry] wandb sample table skipped at step {step}: {exc}", file=sys.stderr)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_samples(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of `<run_dir>/samples.jsonl` (a torn last line is skipped with a warning)."""
    return [record for _, record in parse_lines(Path(run_dir) / SAMPLES_FILE)]


def truncate_samples(run_dir: str | os.PathLike, step: int) -> int:
    """On resume (rank 0, before the SampleLogger opens the file): drop records after `step`, atomically (temp
    file, fsync, rename). Returns the number dropped."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.exists():
        return 0
    records = parse_lines(path)
    kept = [line for line, r in records if not isinstance(r.get("step"), int | float) or r["step"] <= step]
    rewrite_lines(path, kept)
    return len(records) - len(kept)


__all__ = ["ROW_KEYS", "SAMPLES_FILE", "SampleLogger", "episode_fields", "episode_transcript", "markdown_table",
           "read_samples", "truncate_samples"]
