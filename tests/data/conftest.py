"""Fixtures for the data tests: fixture files are written by the tests into tmp_path; nothing is checked in."""

from __future__ import annotations

import pytest
from datahelp import synthetic_rows


@pytest.fixture
def sft_store(tmp_path):
    """A 300-row SFT store in small blocks (several files' worth of I/O ranges, file size not page-aligned)."""
    from ds_rlhf.data.writer import write_store

    path = write_store(tmp_path / "store", "sft", synthetic_rows(300), block_rows=7, file_rows=120)
    return path


@pytest.fixture
def tok(tiny_tokenizer):
    return tiny_tokenizer
