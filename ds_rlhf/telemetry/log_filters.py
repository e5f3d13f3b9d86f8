"""Third-party log lines kept short and few: a `logging.Filter` for the handlers of a library's logging config.

`QuietLogs` sits on the handler vLLM logs through (see `rollout/vllm_logging.py`), so it sees the records of every
`vllm.*` logger in every process vLLM configures:
- a message in DROP is not shown at all: vLLM logs "Successfully reset prefix cache" at INFO once per weight sync;
- a message longer than MAX_CHARS is cut to its first HEAD_CHARS characters with a note of how many were left out
  (the engine's ~3,000-character config dump; the line of non-default engine arguments);
- the same message is shown at most MAX_REPEATS times; the last one shown says that later repeats are not.
A record's traceback (`exc_info`) is kept whole: only the message is shortened.
"""

from __future__ import annotations

import logging

DROP = ("Successfully reset prefix cache",)
MAX_CHARS = 300
HEAD_CHARS = 240
MAX_REPEATS = 2
MAX_TRACKED = 10_000  # distinct messages counted before the counts start over
REPEAT_NOTE = " (repeated; later repeats are not shown)"


def shorten(text: str, max_chars: int = MAX_CHARS, head: int = HEAD_CHARS) -> str:
    """`text` itself when it is at most `max_chars` long, else its first `head` characters and a note."""
    if len(text) <= max_chars:
        return text
    return f"{text[:head]} ... ({len(text) - head} more characters not shown)"


class QuietLogs(logging.Filter):
    """Drops the DROP messages and repeats past MAX_REPEATS; shortens long messages (see the module's docstring).

    Build it from a `dictConfig` filter entry (`{"()": "ds_rlhf.telemetry.log_filters.QuietLogs"}`); it keeps its
    counts per process."""

    def __init__(self, name: str = "", *, drop: tuple[str, ...] = DROP, max_repeats: int = MAX_REPEATS):
        super().__init__(name)
        self.drop, self.max_repeats = drop, max_repeats
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: let the handler report it as usual
            return True
        if any(part in text for part in self.drop):
            return False
        short = shorten(text)
        if len(self.seen) >= MAX_TRACKED and short not in self.seen:
            self.seen.clear()
        count = self.seen.get(short, 0) + 1
        self.seen[short] = count
        if count > self.max_repeats:
            return False
        if count == self.max_repeats:
            short += REPEAT_NOTE
        if short != text:
            record.msg, record.args = short, None
        return True
