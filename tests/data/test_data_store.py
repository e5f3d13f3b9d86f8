"""Store opening: tokenizer fingerprint checks, kind checks, damaged stores, rows/columns/lengths."""

from __future__ import annotations

import json
import shutil

import pytest
from datahelp import synthetic_rows, write_jsonl

from ds_rlhf.data import StoreFormatError, StoreMismatchError, open_store, tokenizer_fingerprint
from ds_rlhf.data.prep import prep_prompts
from ds_rlhf.data.writer import write_store


def test_fingerprint_is_stable_and_sensitive(tmp_path, tok, tiny_model_path):
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tiny_model_path)
    again.backend_tokenizer.enable_truncation(16)  # runtime settings do not change what ids mean
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    changed = AutoTokenizer.from_pretrained(tiny_model_path)
    changed.chat_template = changed.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert tokenizer_fingerprint(changed) != tokenizer_fingerprint(tok)
    extra = AutoTokenizer.from_pretrained(tiny_model_path)
    extra.add_tokens(["<new_tok>"])
    assert tokenizer_fingerprint(extra) != tokenizer_fingerprint(tok)


def test_store_with_another_tokenizer_is_refused(tmp_path, tok, tiny_model_path):
    from transformers import AutoTokenizer

    res = prep_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}]), tmp_path / "s", tok, progress=False)
    open_store(res, tiny_model_path).close()  # same files: accepted (path form)
    other = AutoTokenizer.from_pretrained(tiny_model_path)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(StoreMismatchError, match=r"was tokenized with .*fingerprint .*Re-run data_prep"):
        open_store(res, other)
    with pytest.raises(StoreMismatchError, match="'prompts' store, but a 'sft' store is needed"):
        open_store(res, tok, expect_kind="sft")


def test_damaged_or_missing_stores(tmp_path, sft_store):
    with pytest.raises(StoreFormatError, match="manifest.json is missing"):
        open_store(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(sft_store, broken)
    data = broken / "data-00001.arrow"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(StoreFormatError, match="truncated or modified"):
        open_store(broken)
    m = json.loads((sft_store / "manifest.json").read_text())
    m["format_version"] = 999
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreFormatError, match="format 999"):
        open_store(broken)


def test_rows_columns_lengths_and_cache(sft_store):
    rows = synthetic_rows(300)
    with open_store(sft_store, cache_bytes=2000) as store:  # a tiny cache forces evictions and re-reads
        assert len(store) == 300 and store.kind == "sft"
        assert [f["rows"] for f in store.manifest["files"]] == [120, 120, 60]
        assert store.num_blocks == 18 + 18 + 9
        assert store.lengths.tolist() == [len(r["input_ids"]) for r in rows]
        for i in (0, 6, 7, 119, 120, 299, 5, 250):
            got = store.row(i)
            assert got["input_ids"] == rows[i]["input_ids"] and got["loss_mask"] == rows[i]["loss_mask"]
        np_row = store.row(42, as_numpy=True)
        assert np_row["input_ids"].dtype.name == "int32" and np_row["input_ids"].tolist() == rows[42]["input_ids"]
        assert store.column("row_id").to_pylist() == list(range(300))
        assert store.to_table().num_rows == 300
        with pytest.raises(IndexError):
            store.row(300)
        with pytest.raises(KeyError):
            store.column("nope")


def test_empty_store_is_valid(tmp_path):
    path = write_store(tmp_path / "empty", "prompts", [])
    with open_store(path) as store:
        assert len(store) == 0 and store.lengths.shape == (0,)
