"""Checks of one input row's values before it is converted: each problem is a `RowError` (counted and reported with
the row's file and line under `--on-error skip`, the first one fatal under `fail`), never an exception that ends the
whole prep.

- `loads_row`: a JSON row parsed strictly. A key given twice in one object is `duplicate_key` (JSON readers keep
  the last value silently, so half of what the user wrote would vanish); nesting deeper than `MAX_DEPTH` levels
  (or deeper than Python's parser can recurse) is `too_deep`.
- `check_values`: every string of a parsed row (any format) is text: no lone surrogates (`\\ud800` escapes decode to
  them, and no tokenizer or UTF-8 writer accepts them: `bad_encoding`), no NUL characters (`nul_character`: a
  prompt of NULs is no prompt); and no value nests deeper than `MAX_DEPTH`. The walk is iterative, so a deep row
  cannot exhaust the interpreter's stack.
"""

from __future__ import annotations

import json

MAX_DEPTH = 64  # levels of lists/objects in one row; chat rows and tool schemas need far fewer


class RowError(Exception):
    """Why one row cannot be used; `reason` is a short counter key (e.g. "missing_field")."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _first_duplicate(pairs: list[tuple[str, object]]) -> str | None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


def loads_row(text: str):
    """`json.loads(text)`; RowError("duplicate_key") naming the key, RowError("too_deep") past MAX_DEPTH levels."""
    duplicates: list[str] = []

    def pairs_hook(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs) and not duplicates:
            duplicates.append(_first_duplicate(pairs))
        return obj

    try:
        obj = json.loads(text, object_pairs_hook=pairs_hook)
    except RecursionError:
        raise RowError("too_deep", f"JSON nested deeper than the parser can follow (rows may nest at most "
                                   f"{MAX_DEPTH} levels)") from None
    if duplicates:
        raise RowError("duplicate_key", f"key {duplicates[0]!r} appears more than once in one object (a JSON "
                                        "reader keeps only the last value); keep one")
    for _ in _nodes(obj):  # the depth: the parser's own limit follows the interpreter's recursion limit
        pass
    return obj


def check_values(value, field: str = "") -> None:
    """RowError naming the field when a string of `value` is not text or `value` nests past MAX_DEPTH."""
    for item, where in _nodes(value, field):
        if isinstance(item, str):
            _check_string(item, where)


def _nodes(value, field: str = ""):
    """Every value within `value` (itself included) with its field path, iteratively (no recursion limit);
    RowError("too_deep") naming the field at a list/object nested MAX_DEPTH levels down."""
    stack = [(value, field, 0)]
    while stack:
        item, where, depth = stack.pop()
        yield item, where
        if not isinstance(item, dict | list | tuple):
            continue
        if depth >= MAX_DEPTH:
            raise RowError("too_deep", f"field '{where}' nests more than {MAX_DEPTH} levels of lists/objects")
        if isinstance(item, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in item.items()]
        else:
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item)]


def _check_string(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError("bad_encoding", f"field '{where}': lone surrogate {value[exc.start]!r} at character "
                                       f"{exc.start + 1} (not valid Unicode text)") from None
    nul = value.find("\x00")
    if nul >= 0:
        raise RowError("nul_character", f"field '{where}': NUL character (U+0000) at character {nul + 1} of "
                                        f"{len(value)} (not text; is the file binary or mis-encoded?)")
