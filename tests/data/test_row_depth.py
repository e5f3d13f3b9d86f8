"""A JSONL row nested past `row_checks.MAX_DEPTH` is `too_deep` whatever the interpreter's recursion limit (some
libraries raise it, which lets `json.loads` follow 2,000 levels)."""

from __future__ import annotations

import sys

import pytest

from ds_rlhf.data.row_checks import MAX_DEPTH, RowError, loads_row


@pytest.mark.parametrize("limit", [1000, 100_000])
def test_a_deep_row_is_too_deep_at_any_recursion_limit(limit):
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        with pytest.raises(RowError, match="too_deep"):
            loads_row("[" * 2000 + "]" * 2000)
        with pytest.raises(RowError, match="too_deep"):
            loads_row('{"a": ' + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "}")
        assert isinstance(loads_row("{\"a\": " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}")["a"], list)
    finally:
        sys.setrecursionlimit(before)
