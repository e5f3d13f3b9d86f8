"""GSM8K prep (ground truth after ####) and SFT prep (assistant-only loss masks, every conversation shape)."""

from __future__ import annotations

import json
import shutil

import pytest
from datahelp import read_dropped, write_jsonl

from data_prep.prep_gsm8k import prep_gsm8k
from data_prep.prep_sft import prep_sft
from ds_rlhf.data import open_store
from ds_rlhf.data.convert import Encoder
from ds_rlhf.data.formats import DataPrepError


def _masked_text(tok, row) -> str:
    return tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])


def test_gsm8k_fixture_with_bad_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "gsm.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Big?", "answer": "lots\n#### 1,250"},
        {"question": "No marker?", "answer": "just text"},
        {"answer": "#### 3"},
        "{oops",
    ])
    res = prep_gsm8k(path, tmp_path / "out", tok, progress=False)
    assert res.dropped == {"no_ground_truth": 1, "missing_field": 1, "malformed_json": 1}
    assert {d["row_id"]: d["reason"] for d in read_dropped(res.path)} == {
        3: "no_ground_truth", 4: "missing_field", 5: "malformed_json"}
    a, b = open_store(res, tok, "prompts").rows([0, 1])
    assert a["ground_truth"] == "7" and b["ground_truth"] == "1250" and a["data_source"] == "openai/gsm8k"
    assert "output the final answer after \"####\"" in a["prompt_text"]
    assert json.loads(a["extra"])["answer"].endswith("#### 7")
    with pytest.raises(DataPrepError, match="gsm.jsonl:3: no_ground_truth"):
        prep_gsm8k(path, tmp_path / "fail", tok, on_error="fail", progress=False)


def test_gsm8k_as_sft(tmp_path, tok):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}])
    row = open_store(prep_gsm8k(path, tmp_path / "out", tok, kind="sft", progress=False), tok, "sft").row(0)
    assert _masked_text(tok, row) == "1 + 1 = 2\n#### 2<|im_end|>"


def test_gsm8k_real_test_split(tmp_path, tok, shared_data):
    src = shared_data / "gsm8k" / "test.jsonl"
    res = prep_gsm8k(src, tmp_path / "out", tok, progress=False)
    lines = src.read_text(encoding="utf-8").splitlines()
    answers = [json.loads(line)["answer"].split("####")[-1].strip().replace(",", "") for line in lines]
    store = open_store(res, tok, "prompts")
    assert res.manifest["row_counts"]["read"] == 1319 and len(store) + sum(res.dropped.values()) == 1319
    truths = store.column("ground_truth").to_pylist()
    ids = store.column("row_id").to_pylist()
    assert truths == [answers[i - 1] for i in ids]


def test_sft_messages_mask_covers_assistant_turns_only(tmp_path, tok):
    conv = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5 #### 5"}, {"role": "user", "content": "And 1 + 1?"},
            {"role": "assistant", "content": "2 #### 2"}]
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": conv}])
    row = open_store(prep_sft(path, tmp_path / "out", tok, progress=False), tok, "sft").row(0)
    assert row["input_ids"] == list(tok.apply_chat_template(conv, return_dict=False))
    assert _masked_text(tok, row) == "5 #### 5<|im_end|>2 #### 2<|im_end|>"
    assert row["loss_mask"][-1] == 0  # the newline after the last <|im_end|> is template, not assistant


def test_sft_pairs_sharegpt_and_plain_text(tmp_path, tok):
    path = write_jsonl(tmp_path / "mix.jsonl", [
        {"prompt": "hi", "response": "hello"},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"instruction": "say x", "output": "x"},
    ])
    store = open_store(prep_sft(path, tmp_path / "out", tok, progress=False))
    assert [_masked_text(tok, r) for r in store.rows([0, 1, 2])] == ["hello<|im_end|>", "a<|im_end|>", "x<|im_end|>"]
    raw = open_store(prep_sft(path, tmp_path / "raw", tok, apply_chat_template=False, messages_key="",
                              prompt_key="prompt", response_key="response", progress=False))
    assert len(raw) == 1
    row = raw.row(0)
    assert tok.decode(row["input_ids"]) == "hihello<|im_end|>" and _masked_text(tok, row) == "hello<|im_end|>"


def test_sft_bad_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": [{"role": "user", "content": "only a question"}]},   # 1: nothing to learn
        {"prompt": "hi", "response": ""},                                 # 2: empty response
        {"text": "unknown shape"},                                        # 3: missing field
        {"messages": [{"role": "user", "content": "q " * 100}, {"role": "assistant", "content": "a"}]},  # 4
        {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]},
    ])
    res = prep_sft(path, tmp_path / "out", tok, max_len=40, progress=False)
    assert {d["row_id"]: d["reason"] for d in read_dropped(res.path)} == {
        1: "no_assistant_turn", 2: "empty_response", 3: "missing_field", 4: "too_long"}
    # truncation that leaves no assistant token is still a drop (reason too_long), never a silent empty row
    res = prep_sft(path, tmp_path / "t", tok, max_len=40, overlong="truncate", progress=False)
    assert res.dropped["too_long"] == 1


def test_sft_truncate_keeps_start_and_mask(tmp_path, tok):
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 60}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": conv}])
    row = open_store(prep_sft(path, tmp_path / "out", tok, max_len=30, overlong="truncate", progress=False)).row(0)
    full = list(tok.apply_chat_template(conv, return_dict=False))
    assert row["input_ids"] == full[:30] and len(row["loss_mask"]) == 30 and row["loss_mask"][-1] == 1


def test_mask_without_generation_tags_matches_tagged_template(tmp_path, tok, tiny_model_path):
    """Templates without {% generation %} tags get masks by prefix diffing; they must agree with the tags."""
    from transformers import AutoTokenizer

    plain_dir = tmp_path / "tok"
    shutil.copytree(tiny_model_path, plain_dir)
    plain = AutoTokenizer.from_pretrained(plain_dir)
    plain.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    enc_tags, enc_plain = Encoder(tok), Encoder(plain)
    assert enc_tags.has_generation_tags and not enc_plain.has_generation_tags
    conv = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5 #### 5"},
            {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "sure"}]
    assert enc_plain.encode_conversation(conv) == enc_tags.encode_conversation(conv)
