"""Data prep fails loudly on bad input and never loses a store.

* 0 rows written (empty file, wrong schema, wrong prep script) is an error unless `allow_empty`.
* Undecodable bytes are bad rows under --on-error; truncated/corrupt files are one-line errors naming the file.
* Temp dirs of killed preps are cleaned up; --overwrite swaps the new store in, so a crash never leaves none.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datahelp import read_dropped, write_jsonl

from ds_rlhf.data import StoreFormatError, open_store
from ds_rlhf.data.formats import DataPrepError
from ds_rlhf.data.prep import cli, prep_gsm8k, prep_preferences, prep_prompts, prep_sft

PREPS = {"prep_prompts": prep_prompts, "prep_gsm8k": prep_gsm8k, "prep_sft": prep_sft,
         "prep_preferences": prep_preferences}
PAIR = {"chosen": "\n\nHuman: 2 + 2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2 + 2?\n\nAssistant: 5"}  # HH-RLHF


def _leftovers(tmp_path, name="out"):
    return sorted(p.name for p in tmp_path.glob(f".{name}.*"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _sft_file(path, text):
    return write_jsonl(path, [{"prompt": "say it", "response": text}])


def _sft_text(store_path, tok) -> str:
    return tok.decode(open_store(store_path).row(0)["input_ids"])


# -- (6) zero rows --------------------------------------------------------------------------------------------
def test_wrong_prep_script_for_the_file_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "prefs.jsonl", [PAIR] * 3)
    with pytest.raises(DataPrepError, match=r"0 rows kept from \S*prefs\.jsonl: 3 dropped \(missing_field: 3\)"):
        prep_sft(path, tmp_path / "out", tok, progress=False)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_wrong_schema_parquet_is_an_error(tmp_path, tok):
    pq.write_table(pa.Table.from_pylist([{"a": i, "b": "x"} for i in range(4)]), tmp_path / "t.parquet")
    with pytest.raises(DataPrepError, match=r"0 rows kept from \S*t\.parquet: 4 dropped \(missing_field: 4\)"):
        prep_prompts(tmp_path / "t.parquet", tmp_path / "out", tok, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(PREPS))
def test_empty_input_is_an_error_unless_allow_empty(tmp_path, tok, name):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataPrepError, match=r"0 rows kept from \S*empty\.jsonl: .*no rows.*--allow-empty"):
        PREPS[name](path, tmp_path / "out", tok, progress=False)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
    res = PREPS[name](path, tmp_path / "out", tok, allow_empty=True, progress=False)
    assert len(open_store(res)) == 0 and res.manifest["row_counts"] == {"read": 0, "written": 0, "dropped": 0}


def test_all_rows_dropped_names_every_file_and_reason(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "   "}, "{broken"])
    b = write_jsonl(tmp_path / "b.jsonl", [{"nothing": 1}])
    with pytest.raises(DataPrepError) as info:
        prep_prompts([a, b], tmp_path / "out", tok, progress=False)
    msg = str(info.value)
    assert "a.jsonl" in msg and "b.jsonl" in msg and "3 dropped" in msg and "\n" not in msg
    assert "empty_prompt: 1" in msg and "malformed_json: 1" in msg and "missing_field: 1" in msg


def test_cli_zero_rows_is_one_line_and_allow_empty_flag(tmp_path, tok, tiny_model_path, capsys):
    path = write_jsonl(tmp_path / "prefs.jsonl", [PAIR] * 2)
    argv = ["--tokenizer", str(tiny_model_path), "--input", str(path), "--output", str(tmp_path / "o"), "--quiet"]
    assert cli("prep_sft", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prep_sft: error: 0 rows kept from ") and "Traceback" not in err
    assert "missing_field: 2" in err
    assert cli("prep_sft", argv + ["--allow-empty"]) == 0
    assert "wrote 0 sft rows" in capsys.readouterr().out and len(open_store(tmp_path / "o")) == 0


# -- (13a) undecodable bytes ----------------------------------------------------------------------------------
def _latin1_file(path: Path, gz: bool) -> Path:
    lines = [b'{"prompt": "fine"}', '{"prompt": "caf\u00e9"}'.encode("latin-1"), b'{"prompt": "also fine"}']
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_non_utf8_line_is_a_bad_row_under_skip(tmp_path, tok, gz):
    path = _latin1_file(tmp_path / ("latin.jsonl.gz" if gz else "latin.jsonl"), gz)
    res = prep_prompts(path, tmp_path / "out", tok, progress=False)
    assert res.manifest["row_counts"] == {"read": 3, "written": 2, "dropped": 1}
    assert res.dropped == {"bad_encoding": 1}
    assert [(d["row_id"], d["reason"]) for d in read_dropped(res.path)] == [(2, "bad_encoding")]
    assert [r["row_id"] for r in open_store(res).rows([0, 1])] == [1, 3]
    assert f"bad_encoding: 1 (e.g. {path.name}:2)" in res.summary()


def test_non_utf8_line_under_fail_names_file_and_line(tmp_path, tok):
    path = _latin1_file(tmp_path / "latin.jsonl", gz=False)
    with pytest.raises(DataPrepError, match=r"latin\.jsonl:2: bad_encoding"):
        prep_prompts(path, tmp_path / "out", tok, on_error="fail", progress=False)


def test_utf8_bom_is_not_a_bad_row(tmp_path, tok):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi"}).encode() + b"\n")
    assert prep_prompts(path, tmp_path / "out", tok, on_error="fail", progress=False).manifest["rows"] == 1


# -- (13b) unreadable files -----------------------------------------------------------------------------------
def _truncated_gz(tmp_path) -> Path:
    rng = random.Random(0)
    rows = [{"prompt": " ".join(str(rng.random()) for _ in range(20))} for _ in range(300)]
    path = write_jsonl(tmp_path / "cut.jsonl.gz", rows, gz=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _corrupt_parquet(tmp_path) -> Path:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"q{i}"} for i in range(50)]), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # the footer is gone
    return path


def _garbage_parquet(tmp_path) -> Path:
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"this is not parquet at all\n" * 10)
    return path


def _bad_json_array(tmp_path) -> Path:
    path = tmp_path / "arr.json"
    path.write_bytes(b'[{"prompt": "caf\xe9"}]')
    return path


BAD_FILES = {"truncated_gz": (_truncated_gz, r"cut\.jsonl\.gz"), "corrupt_parquet": (_corrupt_parquet, "bad.parquet"),
             "garbage_parquet": (_garbage_parquet, "junk.parquet"), "bad_json_array": (_bad_json_array, "arr.json")}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_unreadable_file_is_a_one_line_error(tmp_path, tok, case):
    make, name = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(DataPrepError, match=name) as info:
        prep_prompts(path, tmp_path / "out", tok, progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("case", ["truncated_gz", "corrupt_parquet"])
def test_cli_unreadable_file_is_one_line_on_stderr(tmp_path, tiny_model_path, capsys, case):
    make, name = BAD_FILES[case]
    argv = ["--tokenizer", str(tiny_model_path), "--input", str(make(tmp_path)), "--output", str(tmp_path / "o"),
            "--quiet"]
    assert cli("prep_prompts", argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prep_prompts: error: ") and "Traceback" not in err
    assert name.replace("\\", "") in err


# -- (13c) stale temp dirs ------------------------------------------------------------------------------------
def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path, tok):
    dead, live = _dead_pid(), os.getppid()
    for name in (f".out.tmp-{dead}", f".out.tmp-{live}", f".out.tmp-{dead}@some-other-host", ".other.tmp-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data-00000.arrow").write_bytes(b"half written")
    prep_sft(_sft_file(tmp_path / "a.jsonl", "A"), tmp_path / "out", tok, progress=False)
    # the dead prep's dir goes; a live process's, another host's and another output's are not ours to delete
    assert _leftovers(tmp_path) == sorted([f".out.tmp-{live}", f".out.tmp-{dead}@some-other-host"])
    assert (tmp_path / ".other.tmp-1").exists()


# -- (13d) atomic --overwrite ---------------------------------------------------------------------------------
def test_failed_swap_keeps_the_old_store(tmp_path, tok, monkeypatch):
    out = tmp_path / "out"
    prep_sft(_sft_file(tmp_path / "a.jsonl", "old answer"), out, tok, progress=False)
    real_rename = os.rename

    def rename(src, dst, *a, **k):
        if ".tmp-" in str(src):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        prep_sft(_sft_file(tmp_path / "b.jsonl", "new answer"), out, tok, overwrite=True, progress=False)
    monkeypatch.undo()
    assert "old answer" in _sft_text(out, tok) and not _leftovers(tmp_path)


def _prep_killed_at(where: str, src, out, tok) -> int:
    """Run an --overwrite prep in a forked child that SIGKILLs itself (kill -9) at `where`; its wait status."""
    real_rename, real_rmtree = os.rename, shutil.rmtree

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def rename(a, b, *args, **kw):
        if where == "mid" and ".tmp-" in str(a):  # the old store is aside, the new one about to go in
            die()
        return real_rename(a, b, *args, **kw)

    def rmtree(path, *args, **kw):
        if where == "after" and ".old-" in str(path) and os.path.exists(path):  # new store in, old not deleted
            die()
        return real_rmtree(path, *args, **kw)

    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.rename, shutil.rmtree = rename, rmtree
            prep_sft(src, out, tok, overwrite=True, progress=False)
        finally:
            os._exit(3)
    return os.waitpid(pid, 0)[1]


@pytest.mark.parametrize("where,survivor", [("mid", "old answer"), ("after", "new answer")])
def test_kill_9_during_overwrite_leaves_a_complete_store(tmp_path, tok, where, survivor):
    out = tmp_path / "out"
    prep_sft(_sft_file(tmp_path / "a.jsonl", "old answer"), out, tok, progress=False)
    new = _sft_file(tmp_path / "b.jsonl", "new answer")
    status = _prep_killed_at(where, new, out, tok)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert _leftovers(tmp_path)  # the killed prep could not clean up after itself
    if where == "mid":  # no store at `out` until the next prep: training says where the old one is
        with pytest.raises(StoreFormatError, match=r"left the old store at \S*\.out\.old-"):
            open_store(out)
    # the next prep into the same output puts the complete store back (or keeps it) and clears the leftovers
    with pytest.raises(DataPrepError, match="--overwrite"):
        prep_sft(new, out, tok, progress=False)
    assert survivor in _sft_text(out, tok) and not _leftovers(tmp_path)


@pytest.mark.parametrize("flag", ["--max_prompt_len", "--block_rows"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_non_positive_lengths_are_refused_by_the_cli(flag, value, tmp_path, capsys):
    """`--max_prompt_len` / `--block_rows` of 0 or less are refused (such a prompt budget would cut every prompt, chat
    header included)."""
    from ds_rlhf.data.prep import cli

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hi there", "label": "1"}\n')
    with pytest.raises(SystemExit) as exit_info:
        cli("prep_prompts", ["--tokenizer", "unused", "--input", str(src), "--output", str(tmp_path / "out"),
                             flag, value, "--truncate"])
    assert exit_info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
