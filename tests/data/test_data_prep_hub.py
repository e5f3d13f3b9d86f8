"""Data prep by Hugging Face Hub names, offline (as the tests run): `--tokenizer ORG/NAME` from a Hub-style cache,
`--input ORG/NAME[:config]` from a prepared `datasets` cache (both built in tmp_path), and the one-line errors when
either is not cached."""

from __future__ import annotations

import datasets.config
import pytest
from datahelp import write_jsonl
from huggingface_hub import constants

from ds_rlhf.data import open_store
from ds_rlhf.data.prep import cli
from ds_rlhf.engines import model_source
from ds_rlhf.testing.hub_cache import place_in_datasets_cache, place_in_hub_cache

TOKENIZER = "ds-rlhf-test/tiny-chat"
GSM8K_ROWS = [{"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(5)]


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty Hub and datasets caches for this test (HF_HUB_CACHE / HF_DATASETS_CACHE), downloads off."""
    hub, data = tmp_path / "hub", tmp_path / "datasets"
    hub.mkdir()
    data.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", data)
    monkeypatch.setattr(model_source, "_RESOLVED", {})
    return hub, data


def test_prep_gsm8k_reads_a_hub_dataset_split_with_a_hub_tokenizer(caches, tmp_path, tiny_model_path, tok, capsys):
    hub, data = caches
    snapshot = place_in_hub_cache(tiny_model_path, hub, TOKENIZER)
    place_in_datasets_cache({"train": write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS),
                             "test": write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:2])}, data,
                            "ds-rlhf-test/tiny-gsm8k", config="main")
    out = tmp_path / "store"
    assert cli("prep_gsm8k", ["--tokenizer", TOKENIZER, "--input", "ds-rlhf-test/tiny-gsm8k:main",
                              "--output", str(out), "--quiet"]) == 0, capsys.readouterr().err
    store = open_store(out, tok, "prompts")
    assert len(store) == 5 and store.rows([4])[0]["ground_truth"] == "8"
    assert store.manifest["tokenizer"]["name"] == str(snapshot)
    assert store.manifest["sources"][0]["path"] == "ds-rlhf-test/tiny-gsm8k:main"
    assert store.manifest["sources"][0]["format"] == "hub_dataset"
    assert store.manifest["sources"][0]["split"] == "train"
    test_out = tmp_path / "test_store"
    assert cli("prep_gsm8k", ["--tokenizer", TOKENIZER, "--input", "ds-rlhf-test/tiny-gsm8k:main", "--split", "test",
                              "--output", str(test_out), "--quiet"]) == 0
    assert len(open_store(test_out, tok, "prompts")) == 2


@pytest.mark.parametrize("name", ["prep_prompts", "prep_gsm8k", "prep_sft", "prep_preferences"])
def test_a_hub_tokenizer_not_cached_offline_is_one_line(name, caches, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", GSM8K_ROWS)
    assert cli(name, ["--tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct", "--input", str(rows),
                      "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"{name}: error: --tokenizer='HuggingFaceTB/SmolLM2-135M-Instruct': ")
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in err
    assert not (tmp_path / "out").exists()


def test_a_hub_dataset_not_cached_offline_is_one_line(caches, tmp_path, tiny_model_path, capsys):
    assert cli("prep_gsm8k", ["--tokenizer", str(tiny_model_path), "--input", "openai/gsm8k:main",
                              "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("prep_gsm8k: error: input 'openai/gsm8k:main' is not a local file, "
                                              "and the Hub dataset openai/gsm8k (split 'train') is not in the "
                                              "datasets cache")
    assert "datasets.load_dataset('openai/gsm8k', 'main', split='train')" in err
    assert not (tmp_path / "out").exists()
    # a local file that is missing stays a missing file, not a Hub name
    assert cli("prep_gsm8k", ["--tokenizer", str(tiny_model_path), "--input", "data/gsm8k.jsonl",
                              "--output", str(tmp_path / "out"), "--quiet"]) == 2
    assert "input data/gsm8k.jsonl does not exist" in capsys.readouterr().err
