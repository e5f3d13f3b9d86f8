"""Preference pairs: HH-RLHF transcripts (gzipped), UltraFeedback-binarized message lists, prompt + responses."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
from datahelp import read_dropped, write_jsonl

from data_prep.prep_preferences import prep_preferences
from ds_rlhf.data import open_store


def _chat(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, return_dict=False))


def test_hh_rlhf_transcripts_gzipped(tmp_path, tok):
    shared = "\n\nHuman: how do I bake bread?\n\nAssistant: Flour, water, yeast.\n\nHuman: and then?"
    path = write_jsonl(tmp_path / "hh.jsonl.gz", [
        {"chosen": shared + "\n\nAssistant: Knead and bake it.", "rejected": shared + "\n\nAssistant: No idea."},
        {"chosen": shared + "\n\nAssistant: same", "rejected": shared + "\n\nAssistant: same"},  # identical
        {"chosen": shared + "\n\nAssistant: x"},                                                  # no rejected
    ], gz=True)
    res = prep_preferences(path, tmp_path / "out", tok, progress=False)
    assert {d["row_id"]: d["reason"] for d in read_dropped(res.path)} == {2: "identical_pair", 3: "missing_field"}
    row = open_store(res, tok, "preference").row(0)
    head = [{"role": "user", "content": "how do I bake bread?"},
            {"role": "assistant", "content": "Flour, water, yeast."}, {"role": "user", "content": "and then?"}]
    assert row["chosen_ids"] == _chat(tok, head + [{"role": "assistant", "content": "Knead and bake it."}])
    assert row["rejected_ids"] == _chat(tok, head + [{"role": "assistant", "content": "No idea."}])


def test_ultrafeedback_binarized_parquet(tmp_path, tok):
    rows = [{"prompt": "Name a colour.", "prompt_id": "p0",
             "chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
             "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Seven."}],
             "score_chosen": 9.0, "score_rejected": 2.0}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "uf.parquet")
    row = open_store(prep_preferences(tmp_path / "uf.parquet", tmp_path / "out", tok, progress=False)).row(0)
    assert row["chosen_ids"] == _chat(tok, rows[0]["chosen"]) and row["rejected_ids"] == _chat(tok, rows[0]["rejected"])


def test_prompt_with_response_strings_and_bad_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"},
        {"chosen": "4", "rejected": "5"},                                   # 2: plain text, no prompt
        {"prompt": "", "chosen": "4", "rejected": "5"},                     # 3: empty prompt
        {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"},
                                                                   {"role": "assistant", "content": "a"}]},  # 4
        {"prompt": "long " * 80, "chosen": "a", "rejected": "b"},           # 5: over-long
    ])
    res = prep_preferences(path, tmp_path / "out", tok, max_len=64, progress=False)
    assert {d["row_id"]: d["reason"] for d in read_dropped(res.path)} == {
        2: "bad_messages", 3: "empty_prompt", 4: "bad_messages", 5: "too_long"}
    row = open_store(res).row(0)
    user = {"role": "user", "content": "2 + 2?"}
    assert row["chosen_ids"] == _chat(tok, [user, {"role": "assistant", "content": "4"}])
    # truncating both sides to the shared prompt would make them identical: dropped, not kept as a non-pair
    res = prep_preferences(path, tmp_path / "t", tok, max_len=64, overlong="truncate", progress=False)
    assert res.dropped["too_long"] == 1 and "truncated" not in res.manifest["notes"]


def test_real_hh_rlhf_harmless_base(tmp_path, tok, shared_data):
    src = shared_data / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    res = prep_preferences(src, tmp_path / "out", tok, max_len=4096, progress=False)
    with gzip.open(src, "rt") as fh:
        raw = [json.loads(line) for line in fh]
    counts = res.manifest["row_counts"]
    assert counts["read"] == len(raw) and counts["written"] + counts["dropped"] == len(raw)
    assert counts["written"] > 0.95 * len(raw)
    store = open_store(res, tok, "preference")
    row = store.row(len(store) // 2)
    pair = raw[row["row_id"] - 1]
    last_chosen = pair["chosen"].rsplit("\n\nAssistant:", 1)[1].strip()
    assert tok.decode(row["chosen_ids"]).endswith(last_chosen + "<|im_end|>\n")
    assert tok.decode(row["chosen_ids"]).startswith("<|im_start|>user\n")
    assert (store.lengths == store.column_lengths("chosen_ids") + store.column_lengths("rejected_ids")).all()
