"""RL prompt prep: verl parquet, OpenRLHF JSONL, saved datasets; bad rows counted, reported, or fatal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datahelp import read_dropped, write_jsonl

from data_prep.prep_prompts import main as prompts_main
from data_prep.prep_prompts import prep_prompts
from ds_rlhf.data import open_store, tokenizer_fingerprint
from ds_rlhf.data.formats import DataPrepError

ROOT = Path(__file__).resolve().parents[2]


def _gen_prompt(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=False))


def test_verl_parquet(tmp_path, tok):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    res = prep_prompts(tmp_path / "train.parquet", tmp_path / "out", tok, progress=False)
    store = open_store(res, tok, "prompts")
    assert len(store) == 5 and store.manifest["row_counts"] == {"read": 5, "written": 5, "dropped": 0}
    row = store.row(3)
    assert row["input_ids"] == _gen_prompt(tok, "What is 3 + 1?")
    assert row["ground_truth"] == "4" and row["data_source"] == "openai/gsm8k" and row["row_id"] == 3
    assert row["prompt_text"].endswith("<|im_start|>assistant\n")
    extra = json.loads(row["extra"])
    assert extra["ability"] == "math" and extra["extra_info"] == {"split": "train", "index": 3}
    assert store.manifest["fields_used"] == {"prompt:prompt": 5, "label:reward_model.ground_truth": 5}


def test_openrlhf_jsonl_with_keys_and_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "rl.jsonl", [{"context": "2 + 2?", "answer_num": 4}, {"context": "3 + 3?"}])
    res = prep_prompts([path], tmp_path / "out", tok, input_key="context", label_key="answer_num",
                       data_source="mine", progress=False)
    store = open_store(res)
    a, b = store.rows([0, 1])
    assert a["input_ids"] == _gen_prompt(tok, "2 + 2?") and a["ground_truth"] == "4" and a["data_source"] == "mine"
    assert b["ground_truth"] is None and b["extra"] is None  # a missing label is allowed unless required
    raw = prep_prompts([path], tmp_path / "raw", tok, input_key="context", apply_chat_template=False,
                       input_template="Q: {}\nA:", progress=False)
    assert open_store(raw).row(0)["prompt_text"] == "Q: 2 + 2?\nA:"


def test_saved_dataset_dir_with_messages(tmp_path, tok):
    from datasets import Dataset

    Dataset.from_list([{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "old answer"}], "label": "x"}]
                      ).save_to_disk(str(tmp_path / "ds"))
    res = prep_prompts(tmp_path / "ds", tmp_path / "out", tok, progress=False)
    row = open_store(res).row(0)
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, return_dict=False)
    assert row["input_ids"] == list(want)  # the trailing assistant turn is not part of an RL prompt
    assert res.manifest["notes"] == {"trailing_assistant_removed": 1}
    # the prompt's messages travel with the row, for reward functions that take chat messages (TRL)
    assert json.loads(row["extra"])["prompt_messages"] == [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}]


def test_a_text_prompt_carries_no_messages(tmp_path, tok):
    res = prep_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "label": "1"}]), tmp_path / "out", tok,
                       progress=False)
    assert "prompt_messages" not in json.loads(open_store(res).row(0)["extra"] or "{}")


def _bad_file(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "fine", "label": "1"},          # line 1
        '{"prompt": "broken',                      # line 2: malformed JSON
        {"question_text": "where is prompt?"},     # line 3: missing field
        {"prompt": "   "},                         # line 4: empty prompt
        {"prompt": "word " * 200},                 # line 5: over-long
        {"prompt": [{"role": "user"}]},            # line 6: bad messages
        {"prompt": "also fine"},                   # line 7
    ])


def test_bad_rows_are_counted_and_reported_with_line_numbers(tmp_path, tok):
    res = prep_prompts(_bad_file(tmp_path), tmp_path / "out", tok, max_prompt_len=64, progress=False)
    m = res.manifest
    assert m["row_counts"] == {"read": 7, "written": 2, "dropped": 5}
    assert m["dropped_by_reason"] == {"malformed_json": 1, "missing_field": 1, "empty_prompt": 1, "too_long": 1,
                                      "bad_messages": 1}
    dropped = {d["row_id"]: d["reason"] for d in read_dropped(res.path)}
    assert dropped == {2: "malformed_json", 3: "missing_field", 4: "empty_prompt", 5: "too_long", 6: "bad_messages"}
    assert [r["row_id"] for r in open_store(res).rows([0, 1])] == [1, 7]
    text = res.summary()
    assert "malformed_json: 1 (e.g. bad.jsonl:2)" in text and "dropped 5" in text


def test_on_error_fail_stops_at_first_bad_row(tmp_path, tok):
    with pytest.raises(DataPrepError, match=r"bad\.jsonl:2: malformed_json"):
        prep_prompts(_bad_file(tmp_path), tmp_path / "out", tok, on_error="fail", progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_over_long_rows_follow_truncate_not_on_error(tmp_path, tok):
    # plus one short row: a store with 0 rows kept is an error of its own (see test_data_prep_nothing_lost.py)
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200}, {"prompt": "short"}])
    res = prep_prompts(path, tmp_path / "out", tok, max_prompt_len=32, overlong="truncate", on_error="fail",
                       progress=False)
    row = open_store(res).row(0)
    full = _gen_prompt(tok, "word " * 200)
    assert row["input_ids"] == full[-32:]  # the end (with the generation prompt) survives
    assert res.manifest["notes"] == {"truncated": 1}
    res = prep_prompts(path, tmp_path / "out2", tok, max_prompt_len=32, on_error="fail", progress=False)
    assert res.dropped == {"too_long": 1}  # --drop under --on-error fail: dropped and counted, not fatal


def test_manifest_records_sources_tokenizer_and_limits(tmp_path, tok, tiny_model_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    res = prep_prompts(path, tmp_path / "out", tiny_model_path, max_prompt_len=99, progress=False)
    m = json.loads((res.path / "manifest.json").read_text())
    assert m["kind"] == "prompts" and m["max_lengths"] == {"max_prompt_len": 99}
    assert m["sources"][0]["path"] == str(path.resolve()) and len(m["sources"][0]["sha256"]) == 64
    assert m["tokenizer"] == {"name": str(tiny_model_path), "fingerprint": tokenizer_fingerprint(tok),
                              "chat_template_applied": True}
    assert m["token_stats"]["input_ids"]["rows"] == 1
    with pytest.raises(DataPrepError, match="--overwrite"):
        prep_prompts(path, tmp_path / "out", tok, progress=False)
    prep_prompts(path, tmp_path / "out", tok, overwrite=True, progress=False)


def test_cli_in_process(tmp_path, tok, tiny_model_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, "oops"])
    rc = prompts_main(["--tokenizer", str(tiny_model_path), "--input", str(path), "--output", str(tmp_path / "o"),
                       "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0 and "wrote 1 prompts rows" in out and "malformed_json: 1 (e.g. p.jsonl:2)" in out
    rc = prompts_main(["--tokenizer", str(tiny_model_path), "--input", str(path), "--output", str(tmp_path / "o2"),
                       "--quiet", "--on-error", "fail"])
    assert rc == 2 and "p.jsonl:2: malformed_json" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["prep_prompts", "prep_gsm8k", "prep_sft", "prep_preferences"])
def test_scripts_help(script):
    out = subprocess.run([sys.executable, str(ROOT / "data_prep" / f"{script}.py"), "--help"], capture_output=True,
                         text=True, cwd=ROOT / "data_prep", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--tokenizer" in out.stdout and "--on-error" in out.stdout and "--truncate" in out.stdout
