"""Source readers and conversation parsing: every format, with malformed rows reported by line/row number."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datahelp import write_jsonl

from ds_rlhf.data.fields import MISSING, get_field, gsm8k_answer, normalize_messages, parse_hh_transcript
from ds_rlhf.data.formats import DataPrepError, RowError, expand_inputs, iter_rows, source_info


def test_jsonl_rows_keep_line_numbers_and_report_malformed_lines(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, "{not json", "", "[1, 2]", {"prompt": "y"}])
    rows = list(iter_rows(path))
    assert [r.row_id for r in rows] == [1, 2, 4, 5]  # the blank line 3 is not a row
    assert rows[0].data == {"prompt": "x"} and rows[3].data == {"prompt": "y"}
    assert rows[1].error.reason == "malformed_json" and rows[1].where == "a.jsonl:2"
    assert rows[2].error.reason == "malformed_json" and "list" in rows[2].error.detail


def test_gzipped_jsonl_and_json_array(tmp_path):
    gz = write_jsonl(tmp_path / "a.jsonl.gz", [{"q": 1}, {"q": 2}], gz=True)
    assert [r.data["q"] for r in iter_rows(gz)] == [1, 2]
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps([{"q": 3}, 7]))
    rows = list(iter_rows(arr))
    assert rows[0].data == {"q": 3} and rows[1].error.reason == "malformed_json"


def test_parquet_rows_with_nested_fields(tmp_path):
    table = pa.table({"prompt": [[{"role": "user", "content": "hi"}]],
                      "reward_model": [{"style": "rule", "ground_truth": "4"}]})
    pq.write_table(table, tmp_path / "t.parquet")
    (row,) = list(iter_rows(tmp_path / "t.parquet"))
    assert row.row_id == 0 and row.where == "t.parquet row 0"
    assert get_field(row.data, "reward_model.ground_truth") == "4"
    assert get_field(row.data, "reward_model.missing") is MISSING


def test_saved_dataset_dirs_and_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}])
    ds.save_to_disk(str(tmp_path / "one"))
    assert [r.data["prompt"] for r in iter_rows(tmp_path / "one")] == ["a", "b"]
    DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    assert [r.data["prompt"] for r in iter_rows(tmp_path / "dd", split="test")] == ["b"]
    with pytest.raises(DataPrepError, match="--split"):
        list(iter_rows(tmp_path / "dd"))


def test_expand_inputs_and_source_hashes(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"x": 1}])
    write_jsonl(d / "a.jsonl", [{"x": 2}])
    (d / "notes.txt").write_text("ignored")
    assert [p.name for p in expand_inputs([d])] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(DataPrepError, match="does not exist"):
        expand_inputs([tmp_path / "nope.jsonl"])
    info = source_info(d / "a.jsonl", "jsonl")
    assert info["bytes"] == (d / "a.jsonl").stat().st_size and len(info["sha256"]) == 64


def test_hh_transcript_parsing():
    text = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: 2+2?\n\nHuman: please\n\nAssistant: 4"
    assert parse_hh_transcript(text) == [
        {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "2+2?\n\nplease"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(RowError):
        parse_hh_transcript("no markers at all")


def test_message_normalisation():
    share = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert normalize_messages(share) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for bad in ([], "text", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}], ["x"]):
        with pytest.raises(RowError) as err:
            normalize_messages(bad)
        assert err.value.reason == "bad_messages"


@pytest.mark.parametrize("answer,expected", [("so 18\n#### 18", "18"), ("#### 1,000", "1000"), ("#### -3.5", "-3.5"),
                                             ("#### $42.", "42")])
def test_gsm8k_answer(answer, expected):
    assert gsm8k_answer(answer) == expected


@pytest.mark.parametrize("answer", ["no marker", "#### many", ""])
def test_gsm8k_answer_errors(answer):
    with pytest.raises(RowError) as err:
        gsm8k_answer(answer)
    assert err.value.reason == "no_ground_truth"
