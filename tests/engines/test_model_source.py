"""Model specs -> local directories (`ds_rlhf/engines/model_source.py`): local directories, Hub ids read from a
Hub-style cache built in tmp_path (offline, as the tests run), `tiny`, and the one-line errors; and the preflight
checks that resolve every model setting of a run before set-up."""

from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines import model_source
from ds_rlhf.engines.model_source import ModelSourceError, resolve_model_source
from ds_rlhf.run.preflight import check_model_sources, check_rl_run
from ds_rlhf.testing.hub_cache import place_in_hub_cache
from tests.recipes.stores import prompt_store

REPO = "ds-rlhf-test/tiny-chat"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face Hub cache for this test (what HF_HUB_CACHE points at), offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_source, "_RESOLVED", {})
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_and_revisions_to_theirs(hub_cache, tiny_model_path, tmp_path):
    snapshot = place_in_hub_cache(tiny_model_path, hub_cache, REPO)
    assert resolve_model_source(REPO) == str(snapshot)
    assert (snapshot / "config.json").is_file() and (snapshot / "tokenizer_config.json").is_file()
    assert resolve_model_source(REPO, "model.tokenizer", "tokenizer") == str(snapshot)
    # another revision: the same files with a changed config, under the tag v2
    other = tmp_path / "v2"
    shutil.copytree(tiny_model_path, other)
    (other / "generation_config.json").write_text("{}")
    v2 = place_in_hub_cache(other, hub_cache, REPO, revision="v2")
    assert v2 != snapshot
    assert resolve_model_source(f"{REPO}@v2") == str(v2)
    assert resolve_model_source(f"{REPO}@{v2.name}") == str(v2)  # a commit hash
    assert resolve_model_source(REPO) == str(snapshot)  # main still points at the first commit


def test_a_hub_id_not_cached_while_offline_is_one_line_saying_how_to_fetch_it(hub_cache):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct", "reward.model")
    text = str(info.value)
    assert "\n" not in text and isinstance(info.value, ConfigError)
    assert text.startswith("reward.model='HuggingFaceTB/SmolLM2-135M-Instruct': ")
    assert "not in the Hugging Face cache " + str(hub_cache) in text
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct`" in text and "HF_HUB_CACHE" in text
    place_in_hub_cache(_model_dir(hub_cache.parent / "m"), hub_cache, REPO)  # cached at main only
    with pytest.raises(ModelSourceError, match=r"@v9'.*hf download ds-rlhf-test/tiny-chat --revision v9"):
        resolve_model_source(f"{REPO}@v9")


def _model_dir(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_a_hub_repo_without_config_json_is_not_a_model(hub_cache, tmp_path):
    gguf_only = tmp_path / "gguf_repo"
    gguf_only.mkdir()
    (gguf_only / "model-q4.gguf").write_bytes(b"GGUF")
    place_in_hub_cache(gguf_only, hub_cache, "ds-rlhf-test/only-gguf")
    with pytest.raises(ModelSourceError, match="only-gguf has no config.json, so it is not a transformers model"):
        resolve_model_source("ds-rlhf-test/only-gguf")


def test_local_paths_that_are_not_model_directories_are_refused_in_one_line(tmp_path, tiny_model_path):
    assert resolve_model_source(str(tiny_model_path)) == str(tiny_model_path)
    cases = {
        str(tmp_path / "missing"): "no such directory",
        str(tiny_model_path / "config.json"): "is a file, not a model directory",
        str(tmp_path): "is not a model directory: it has no config.json",
        "a/b/c": "is neither a local directory nor a Hugging Face Hub id",
        "tiny:huge": "no tiny preset 'huge'",
    }
    for spec, reason in cases.items():
        with pytest.raises(ModelSourceError, match=reason) as info:
            resolve_model_source(spec, "critic.path")
        assert str(info.value).startswith(f"critic.path={spec!r}") and "\n" not in str(info.value)
    not_gguf = tmp_path / "model.Q4_K_M.gguf"
    not_gguf.write_bytes(b"PK\x03\x04")
    with pytest.raises(ConfigError, match=r"model.Q4_K_M.gguf is not a GGUF file \(it starts with") as info:
        resolve_model_source(str(not_gguf))
    assert "\n" not in str(info.value)


def test_tiny_specs_still_build_the_tiny_model(tiny_model_path):
    assert resolve_model_source("tiny") == str(tiny_model_path)


def test_preflight_resolves_model_tokenizer_reward_model_and_critic_hub_ids(hub_cache, tmp_path, tiny_model_path,
                                                                           tiny_reward_path):
    place_in_hub_cache(tiny_model_path, hub_cache, REPO)
    place_in_hub_cache(tiny_reward_path, hub_cache, "ds-rlhf-test/tiny-rm")
    store = prompt_store(tmp_path, tiny_model_path, lengths=(4, 6))
    base = ["--data.train", str(store), "--run.output_dir", str(tmp_path / "run"), "--model.path", REPO,
            "--model.tokenizer", REPO]
    check_rl_run(parse_config([*base, "--reward.fn", "gsm8k"]))
    check_rl_run(parse_config([*base, "--reward.fn", "", "--reward.model", "ds-rlhf-test/tiny-rm",
                               "--rl.algo", "ppo", "--critic.path", "ds-rlhf-test/tiny-rm"]))
    for key in ("model.path", "model.tokenizer", "reward.model", "critic.path"):
        argv = [*base, "--reward.fn", "", "--reward.model", "ds-rlhf-test/tiny-rm", "--rl.algo", "ppo",
                f"--{key}", "ds-rlhf-test/not-cached"]
        with pytest.raises(ConfigError, match=f"^{key}='ds-rlhf-test/not-cached': .*hf download"):
            check_rl_run(parse_config(argv))
    # a teacher for on-policy distillation by Hub id: a cached one resolves, an uncached one is one line
    check_rl_run(parse_config([*base, "--reward.fn", "gsm8k", "--rl.teacher", REPO, "--rl.kl_coef", "1"]))
    with pytest.raises(ConfigError, match="^rl.teacher='ds-rlhf-test/not-cached': .*hf download"):
        check_rl_run(parse_config([*base, "--reward.fn", "gsm8k", "--rl.teacher", "ds-rlhf-test/not-cached",
                                   "--rl.kl_coef", "1"]))
    with pytest.raises(ConfigError, match="^model.path='ds-rlhf-test/not-cached'"):
        check_model_sources(parse_config(["--model.path", "ds-rlhf-test/not-cached"]), "sft")
