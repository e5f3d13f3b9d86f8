"""Plain helpers shared by the data tests (imported as `datahelp`; tests/data has no __init__.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest


def write_jsonl(path: Path, rows, gz: bool = False) -> Path:
    """Rows may be dicts (dumped as JSON) or raw strings (written verbatim, e.g. to make a malformed line)."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def read_dropped(store: Path) -> list[dict]:
    return [json.loads(line) for line in (store / "dropped.jsonl").read_text().splitlines()]


def synthetic_rows(n: int, seed: int = 0, max_len: int = 40) -> list[dict]:
    """SFT-kind rows whose token ids encode their own position, so any mix-up is visible."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(1, max_len))
        rows.append({"input_ids": [i] * length, "loss_mask": [1] * length, "row_id": i, "source_idx": 0})
    return rows


def uring_works() -> bool:
    from ds_rlhf.data.readers import ReaderUnavailable, UringReader

    probe = Path(__file__)
    try:
        UringReader(probe).close()
        return True
    except ReaderUnavailable:
        return False


needs_uring = pytest.mark.skipif(not uring_works(), reason="io_uring is unavailable on this kernel/sandbox")
