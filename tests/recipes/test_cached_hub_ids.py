"""A Hub id (`model.tokenizer`, `model.path`) whose snapshot is in the Hugging Face cache is read from there with no
network call, also when downloads are allowed (HF_HUB_OFFLINE unset); a snapshot holding only part of a model (the
tokenizer files, no weights) still goes to the Hub."""

from __future__ import annotations

import shutil

import huggingface_hub
import pytest
from huggingface_hub import constants

from ds_rlhf.config import parse_config
from ds_rlhf.engines import model_source
from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.run.context import load_run_tokenizer
from ds_rlhf.testing.hub_cache import place_in_hub_cache

REPO = "ds-rlhf-test/cached-tiny"


class NetworkCall(Exception):
    pass


@pytest.fixture
def online_hub(tmp_path, monkeypatch):
    """An empty Hub cache, downloads allowed, and every Hub API call recorded and refused (no network here)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_source, "_RESOLVED", {})
    calls = []

    def refuse(self, repo_id, *args, **kwargs):
        calls.append(repo_id)
        raise NetworkCall(repo_id)

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", refuse)
    assert not model_source.hub_offline()
    return cache, calls


def test_a_cached_tokenizer_hub_id_makes_no_network_call(online_hub, tiny_model_path, tmp_path):
    cache, calls = online_hub
    snapshot = place_in_hub_cache(tiny_model_path, cache, REPO)
    cfg = parse_config(["--model.tokenizer", REPO])
    tokenizer = load_run_tokenizer(cfg, str(tiny_model_path))
    assert tokenizer.name_or_path == str(snapshot)
    assert resolve_model_source(REPO) == str(snapshot)
    assert calls == []


def test_a_snapshot_without_the_weights_is_not_taken_for_the_model(online_hub, tiny_model_path, tmp_path):
    cache, calls = online_hub
    tokenizer_only = tmp_path / "tokenizer_only"
    shutil.copytree(tiny_model_path, tokenizer_only, ignore=shutil.ignore_patterns("*.safetensors"))
    snapshot = place_in_hub_cache(tokenizer_only, cache, REPO)
    assert resolve_model_source(REPO, "model.tokenizer", "tokenizer") == str(snapshot)
    assert calls == []
    with pytest.raises(NetworkCall):  # the weights are not cached: this one asks the Hub
        resolve_model_source(REPO)
    assert calls == [REPO]
