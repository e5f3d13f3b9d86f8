"""The offline tiny-model kit: deterministic, loadable, and the shapes vLLM's CPU backend needs."""

from __future__ import annotations

import hashlib
import json

import torch

from ds_rlhf.engines.tiny_models import PRESETS, TinySpec, build_tiny_model


def _digest_dir(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_same_seed_gives_byte_identical_files(tmp_path):
    spec = TinySpec(seed=3, corpus_lines=600)
    a = build_tiny_model(tmp_path / "a", spec)
    b = build_tiny_model(tmp_path / "b", spec)
    assert _digest_dir(a) == _digest_dir(b)
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(_digest_dir(a))


def test_different_seed_gives_different_weights(tmp_path):
    a = build_tiny_model(tmp_path, TinySpec(seed=1, corpus_lines=600))
    b = build_tiny_model(tmp_path, TinySpec(seed=2, corpus_lines=600))
    assert a != b
    assert _digest_dir(a)["model.safetensors"] != _digest_dir(b)["model.safetensors"]


def test_second_build_reuses_cache(tmp_path):
    spec = TinySpec(seed=4, corpus_lines=600)
    first = build_tiny_model(tmp_path, spec)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path, spec) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_head_dim_is_64_for_every_preset():
    for spec in PRESETS.values():
        assert spec.hidden_size // spec.num_heads == 64


def test_hf_forward_and_chat_template(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "#### 5"}]
    enc = tiny_tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids = torch.tensor([enc["input_ids"]])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(out.loss)
    # digits are single tokens, and the assistant mask covers the answer and its end-of-turn token only
    mask = enc["assistant_masks"]
    answer = tiny_tokenizer.decode([t for t, m in zip(enc["input_ids"], mask) if m])
    assert answer == "#### 5<|im_end|>"
    assert all(len(tiny_tokenizer.decode([tiny_tokenizer.convert_tokens_to_ids(d)])) == 1 for d in "0123456789")


def test_reward_model_scores_a_batch(tiny_reward_path, tiny_tokenizer):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_path)
    enc = tiny_tokenizer(["What is 1 + 1?", "Hello there, model"], return_tensors="pt", padding=True)
    scores = model(**enc).logits
    assert scores.shape == (2, 1)
    assert torch.isfinite(scores).all()
