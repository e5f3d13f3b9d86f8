"""A store is refused when its files are not the ones its manifest recorded (size and sha256 of every data file and
lengths.npy), or when the manifest's figures (rows, token statistics) are not those of its data; verifying costs one
hash per file version (`.verified.json`), and stores from before the checksums open with one warning."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
from datahelp import synthetic_rows, write_jsonl

from ds_rlhf.data import StoreFormatError, open_store
from ds_rlhf.data import store_checks as store_module
from ds_rlhf.data.prep import prep_prompts
from ds_rlhf.data.writer import write_store


@pytest.fixture
def prompt_store(tmp_path, tok):
    """2000 real prompts through prep (chat template, manifest with token statistics)."""
    rows = [{"prompt": f"What is {i} + {i % 97}? Answer after ####.", "answer": str(i + i % 97)} for i in range(2000)]
    return prep_prompts(write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "store", tok, progress=False).path


@pytest.fixture(autouse=True)
def fresh_process_cache(monkeypatch):
    """Each test starts as a new process would: nothing verified yet, no warning given."""
    monkeypatch.setattr(store_module, "_verified", {})
    monkeypatch.setattr(store_module, "_unverifiable_warned", set())


def _flip(path, offset: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_flipped_bytes_in_a_data_file_are_refused_naming_the_store_and_file(prompt_store):
    data = prompt_store / "data-00000.arrow"
    _flip(data, os.path.getsize(data) // 2, 2048)
    with pytest.raises(StoreFormatError) as info:
        open_store(prompt_store)
    text = _one_line(info)
    assert f"store {prompt_store}: {data} has another sha256 than when it was written" in text


def test_damage_after_a_verified_open_is_still_caught(prompt_store):
    open_store(prompt_store).close()  # verified and remembered (this process and .verified.json)
    assert (prompt_store / store_module.VERIFIED).is_file()
    store_module._verified.clear()  # a later process reads the sidecar
    open_store(prompt_store).close()
    lengths = prompt_store / "lengths.npy"
    _flip(lengths, os.path.getsize(lengths) - 8, 4)  # a write changes mtime / ctime: hashed again
    with pytest.raises(StoreFormatError, match=rf"{lengths} has another sha256"):
        open_store(prompt_store)


def test_repeated_opens_hash_each_file_once(prompt_store, monkeypatch):
    hashed = []
    real = store_module.file_checksum
    monkeypatch.setattr(store_module, "file_checksum", lambda p: hashed.append(p.name) or real(p))
    open_store(prompt_store).close()
    assert sorted(hashed) == ["data-00000.arrow", "lengths.npy"]
    open_store(prompt_store).close()
    store_module._verified.clear()  # as a new process: the sidecar says these very files were verified
    open_store(prompt_store).close()
    assert len(hashed) == 2


@pytest.mark.parametrize("edit", ["rows", "max", "file_rows"])
def test_manifest_figures_that_disagree_with_the_data_are_refused(prompt_store, edit):
    path = prompt_store / "manifest.json"
    manifest = json.loads(path.read_text())
    if edit == "rows":  # fewer rows than the data holds
        manifest["rows"] -= 1
        manifest["files"][0]["blocks"][-1][2] -= 1
        manifest["files"][0]["rows"] -= 1
    elif edit == "max":  # a longest prompt that would pass a run's length check
        manifest["token_stats"]["input_ids"]["max"] = 8
    else:
        manifest["files"][0]["rows"] += 5
    path.write_text(json.dumps(manifest))
    with pytest.raises(StoreFormatError) as info:
        open_store(prompt_store)
    text = _one_line(info)
    assert text.startswith(f"store {prompt_store}: manifest.json says") and "re-run data prep" in text
    assert str(prompt_store / ("data-00000.arrow" if edit == "file_rows" else "lengths.npy")) in text


def test_store_without_checksums_opens_with_one_warning(tmp_path, caplog):
    path = write_store(tmp_path / "old", "sft", synthetic_rows(50), block_rows=7)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["checksums"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="ds_rlhf.data"):
        for _ in range(2):
            with open_store(path) as store:
                assert len(store) == 50
    warnings = [r.getMessage() for r in caplog.records if "checksums" in r.getMessage()]
    assert warnings == [f"{path}: the manifest has no checksums (a store from an older data prep): its files "
                        "cannot be verified; re-run the prep to add them"]


def test_write_store_records_size_and_sha256_of_every_file(tmp_path):
    path = write_store(tmp_path / "s", "sft", synthetic_rows(300), block_rows=7, file_rows=120)
    sums = json.loads((path / "manifest.json").read_text())["checksums"]
    assert sorted(sums) == ["data-00000.arrow", "data-00001.arrow", "data-00002.arrow", "lengths.npy"]
    for name, info in sums.items():
        data = (path / name).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
