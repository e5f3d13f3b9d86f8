"""The fields of one input row: dotted keys into nested dicts, the first of several names, ground truths as text.

Conversation shapes: chat `messages` ({role, content}), ShareGPT ({from, value}), and HH-RLHF transcripts
("\n\nHuman: ...\n\nAssistant: ...") are all turned into [{role, content}] for the tokenizer's chat template.
"""

from __future__ import annotations

import json
import re

from .row_checks import RowError

MISSING = object()


def get_field(row: dict, key: str):
    """row[key], following dots into nested dicts ("reward_model.ground_truth"); MISSING when absent or None."""
    if key in row:
        value = row[key]
    else:
        value = row
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return MISSING
            value = value[part]
    return MISSING if value is None else value


def first_field(row: dict, keys, what: str):
    """(key, value) of the first present key; RowError("missing_field") naming all tried keys otherwise."""
    for key in keys:
        value = get_field(row, key)
        if value is not MISSING:
            return key, value
    raise RowError("missing_field", f"no {what} field (tried {', '.join(keys)}; row has {', '.join(sorted(row))})")


_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                 "model": "assistant", "system": "system", "tool": "tool"}


def normalize_messages(value) -> list[dict]:
    """[{role, content}] from chat messages or ShareGPT turns; RowError("bad_messages") when malformed.

    Parquet/Arrow sources turn message lists into lists of structs (dicts), so both paths land here.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError("bad_messages", f"expected a non-empty list of messages, got {type(value).__name__}")
    out = []
    for n, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise RowError("bad_messages", f"message {n} is a {type(msg).__name__}, not an object")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if not isinstance(role, str) or role.lower() not in _ROLE_ALIASES:
            raise RowError("bad_messages", f"message {n} has no known role ({role!r})")
        if not isinstance(content, str):
            raise RowError("bad_messages", f"message {n} content is {type(content).__name__}, not text")
        out.append({"role": _ROLE_ALIASES[role.lower()], "content": content})
    return out


_HH_SPLIT = re.compile(r"\n\n(Human|Assistant): ?")


def parse_hh_transcript(text: str) -> list[dict]:
    """HH-RLHF "\n\nHuman: ...\n\nAssistant: ..." -> messages; consecutive turns of one speaker are merged."""
    if not isinstance(text, str):
        raise RowError("bad_messages", f"expected a transcript string, got {type(text).__name__}")
    body = text if text.startswith("\n\n") else "\n\n" + text.lstrip()
    parts = _HH_SPLIT.split(body)
    if parts[0].strip() or len(parts) < 3:
        raise RowError("bad_messages", "transcript does not start with a Human:/Assistant: turn")
    messages: list[dict] = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        role = "user" if speaker == "Human" else "assistant"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content.strip()
        else:
            messages.append({"role": role, "content": content.strip()})
    return messages


def looks_like_hh(text) -> bool:
    return isinstance(text, str) and bool(re.match(r"\s*(Human|Assistant):", text))


def as_text(value) -> str:
    """Ground truths come as strings, numbers or lists; store them as a string (JSON for non-scalars)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_answer(answer: str) -> str:
    """The final number after '####' in a GSM8K solution, without thousands separators ("1,000" -> "1000")."""
    m = _GSM8K_ANSWER.search(answer or "")
    if not m:
        raise RowError("no_ground_truth", "answer has no '#### <number>' line")
    value = m.group(1).strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(\.\d+)?", value):
        raise RowError("no_ground_truth", f"text after '####' is not a number: {m.group(1)!r}")
    return value
