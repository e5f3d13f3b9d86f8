"""Secrets inside URLs kept out of what a run writes or prints: `config.json`, the log, the wandb config and error
lines show a URL's password (or lone userinfo token) and every query-string value as `***`.

    http://user:pw@host/score?token=abc&v=2  ->  http://user:***@host/score?token=***&v=***

Every query value is hidden, not only those named like a token: a secret's parameter name is the server's choice.
A `config.json` given back as `--config` therefore needs such a URL again on the command line.
"""

from __future__ import annotations

import re

URL = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s'\",/?#]*@)?([^\s'\",?#]*)(\?[^\s'\",#]*)?")
MASK = "***"


def _userinfo(info: str) -> str:
    user, sep, _ = info[:-1].partition(":")
    return f"{user}:{MASK}@" if sep else f"{MASK}@"


def _query(query: str) -> str:
    parts = [p.partition("=") for p in query[1:].split("&")]
    return "?" + "&".join(f"{k}={MASK}" if sep else k for k, sep, _ in parts)


def redact_urls(text: str) -> str:
    """`text` with each URL's userinfo secret and query values replaced by `***` (other text unchanged)."""
    def one(match: re.Match) -> str:
        scheme, info, rest, query = match.groups()
        return scheme + (_userinfo(info) if info else "") + rest + (_query(query) if query else "")
    return URL.sub(one, text) if "://" in text else text


def redacted(value):
    """A copy of a JSON-like value (dicts, lists, strings) with `redact_urls` applied to every string."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value
