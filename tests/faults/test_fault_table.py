"""Bad inputs and faults as a table: each row is an input or a command, what the user must see (one `error:` line
holding a given text and an exit status, or the exception a library caller gets, or the answer a parser gives) and
what is left on disk. A new feature adds its rows here.

Rows run in this process (the commands through `ds_rlhf.entrypoints.main.main`, the library calls directly), so
the whole table costs seconds: a subprocess per row would pay the imports each time. The rows that build a run need
none of it: their faults sit in the pieces a run uses (the checkpoint manager, the loader, the store), called the way
the trainers call them. The slower end-to-end cases live beside their features (tests/recipes/test_abuse.py,
tests/recipes/test_user_error_audit.py).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.agent.tool_calls import parse_tool_calls
from ds_rlhf.atomic_files import publish_dir
from ds_rlhf.cli import USER_ERRORS, run_entry
from ds_rlhf.data.loader import StoreLoader
from ds_rlhf.data.store import open_store
from ds_rlhf.data.store_checks import StoreFormatError
from ds_rlhf.data.writer import write_store
from ds_rlhf.entrypoints.main import main as ds_rlhf
from ds_rlhf.rewards.reward_set import RewardSet
from ds_rlhf.run.checkpoint import manager as checkpoints_module
from ds_rlhf.run.checkpoint.files import MARKER, hash_tree, list_files
from ds_rlhf.run.checkpoint.manager import (
    CheckpointLoadError,
    CheckpointManager,
    CheckpointSaveError,
    CheckpointSpaceError,
)
from ds_rlhf.run.monitor import RunMonitor

DEEP = "[" * 1100 + "]" * 1100  # 2.2 KB of nesting: past Python's recursion limit


@dataclass(frozen=True)
class Fault:
    """One row. `act(ctx)` runs the input; ctx has `tmp` (a fresh directory), `tokenizer` (the tiny model's
    directory) and `monkeypatch`. Exactly one expectation applies:
    - `code`: act returns a command's exit status; stderr holds one `error:` line with `expect` and no traceback;
    - `raises`: act raises it, its message one line holding `expect`;
    - neither: act returns text (a parser's answer) holding `expect`.
    `left(ctx)` then checks what is on disk."""

    id: str
    act: Callable[[SimpleNamespace], object]
    expect: str = ""
    code: int | None = None
    raises: type | tuple = ()
    left: Callable[[SimpleNamespace], None] | None = None


# ---- inputs --------------------------------------------------------------------------------------------------------
def _jsonl(ctx, *rows: str, name: str = "in.jsonl") -> Path:
    path = ctx.tmp / name
    path.write_text("".join(row + "\n" for row in rows))
    return path


def _prep(ctx, src: Path, *extra: str) -> int:
    return ds_rlhf(["prep-prompts", "--tokenizer", str(ctx.tokenizer), "--input", str(src), "--output",
                    str(ctx.tmp / "store"), "--quiet", *extra])


GOOD = json.dumps({"prompt": "What is 2 + 3?", "answer": "5"})


def _dropped(reason: str, rows: int = 1):
    def check(ctx):
        manifest = json.loads((ctx.tmp / "store" / "manifest.json").read_text())
        assert manifest["dropped_by_reason"] == {reason: 1}, manifest["dropped_by_reason"]
        assert manifest["rows"] == rows
    return check


def _nothing_at(name: str):
    def check(ctx):
        assert not (ctx.tmp / name).exists(), f"{name} was written"
    return check


def _fifo(ctx) -> int:
    fifo = ctx.tmp / "in.jsonl"
    os.mkfifo(fifo)  # opening it would block until a writer comes: none does
    return _prep(ctx, fifo)


class _Payload:
    """Unpickling this runs `exec`, which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _handed_checkpoint(ctx) -> None:
    """A checkpoint someone handed over: a payload in its engine file, the COMPLETE manifest recomputed to match."""
    step = ctx.tmp / "run" / "checkpoints" / "step_00000004"
    (step / "actor" / "state").mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}, "payload": _Payload(ctx.tmp / "marker")},
               step / "actor" / "state" / "mp_rank_00_model_states.pt")
    torch.save({"step": 4}, step / "trainer_state.pt")
    manifest = {"format": 2, "step": 4, "files": hash_tree(step, list_files(step))}
    (step / MARKER).write_text(json.dumps(manifest))
    CheckpointManager(ctx.tmp / "run").resolve(str(step))  # the trainers call this before any model is built


def _payload_did_not_run(ctx):
    assert not (ctx.tmp / "marker").exists(), "the payload ran"


class _Engine:
    """DeepSpeed's checkpoint interface over torch.save, with `n` parameters (and their Adam moments)."""

    def __init__(self, n: int):
        self.module = torch.nn.Linear(n, 1, bias=False)

    def save_checkpoint(self, save_dir, tag, client_state):
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), "moments": torch.zeros(2, self.module.in_features)},
                   path / "mp_rank_00_model_states.pt")


def _no_room_at_start(ctx) -> None:
    ctx.monkeypatch.setattr(checkpoints_module, "_free_bytes", lambda path: 1 << 20)
    CheckpointManager(ctx.tmp / "run").check_room({"actor": _Engine(1 << 18)})  # ~3 MiB needed, 1 MiB free


def _save_under_ulimit_f(ctx) -> None:
    manager = CheckpointManager(ctx.tmp / "run")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # `ulimit -f 1024`; Python ignores SIGXFSZ
    try:
        manager.save(1, {"actor": _Engine(1 << 19)}, {})  # a 6 MiB file
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _no_partial_checkpoint(ctx):
    assert not list((ctx.tmp / "run" / "checkpoints").glob("*step_*")), "a (partial) checkpoint was left"


def _sft_store(ctx) -> Path:
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}] * 8
    return write_store(ctx.tmp / "sft", "sft", rows)


def _relabelled(ctx) -> None:
    store = _sft_store(ctx)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "kind": "prompts"}))
    open_store(store, expect_kind="prompts")


def _resumed_with_another_batch_size(ctx) -> None:
    store = _sft_store(ctx)
    saved = StoreLoader(store, 4, prefetch=0, reader="mmap")
    state = saved.state_dict()
    saved.close()
    StoreLoader(store, 2, prefetch=0, reader="mmap").load_state_dict(state)


def _ctrl_c_while_starting(ctx) -> int:
    run = ctx.tmp / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / MARKER).write_text("{}")

    def start(cfg):
        monitor = RunMonitor(cfg, run, is_main=True, kind="sft", environment=False)
        try:
            raise KeyboardInterrupt  # Ctrl-C while the models load, before the training loop's handler
        except BaseException as exc:
            monitor.finish(exc, step=2)
            raise

    try:
        run_entry("doc", {}, start, ["--run.output_dir", str(run)])
    except SystemExit as exc:
        return exc.code
    except KeyboardInterrupt:  # escaping, it would stop pytest itself: a failed row instead
        raise AssertionError("Ctrl-C left the command as an exception (a traceback)") from None
    return 0


def _status_stopped(ctx):
    status = json.loads((ctx.tmp / "run" / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGINT", status


def _reward_that_changes_directory(ctx) -> None:
    (ctx.tmp / "moves.py").write_text("import os\nos.chdir('/')\n\ndef f(completions, **kw):\n"
                                      "    return [1.0] * len(completions)\n")
    (ctx.tmp / "plain.py").write_text("def g(completions, **kw):\n    return [0.5] * len(completions)\n")
    ctx.monkeypatch.chdir(ctx.tmp)
    with RewardSet.from_spec("moves.py:f,plain.py:g", workers=0) as rewards:
        assert rewards.names == ["f", "g"]


def _cwd_kept(ctx):
    assert Path.cwd() == ctx.tmp


def _unsupported_gguf(ctx) -> int:
    import gguf
    import numpy as np

    src = ctx.tmp / "model.gguf"
    writer = gguf.GGUFWriter(str(src), arch="fancy_arch")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ds_rlhf(["convert-gguf", str(src), str(ctx.tmp / "out")])


def _publish_through_symlink(ctx) -> str:
    real = ctx.tmp / "models" / "real"
    real.mkdir(parents=True)
    (real / "old.txt").write_text("old")
    (ctx.tmp / "link").symlink_to(real, target_is_directory=True)
    publish_dir(ctx.tmp / "link", lambda tmp: (tmp / "new.txt").write_text("new"))
    return "published"


def _link_kept(ctx):
    link, real = ctx.tmp / "link", ctx.tmp / "models" / "real"
    assert link.is_symlink() and link.resolve() == real.resolve(), "the link was replaced"
    assert sorted(p.name for p in real.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in ctx.tmp.iterdir()) == ["link", "models"], "something hidden beside the link"
    assert sorted(p.name for p in (ctx.tmp / "models").iterdir()) == ["real"]


def _publish_safetensors(ctx) -> str:
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        publish_dir(ctx.tmp / "export", lambda tmp: save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors")))
    finally:
        os.umask(old)
    return "published"


def _mode_0644(ctx):
    mode = (ctx.tmp / "export" / "model.safetensors").stat().st_mode & 0o777
    assert mode == 0o644, oct(mode)


def _empty_dir_untouched(ctx):
    assert list((ctx.tmp / "notarun").iterdir()) == [], "the report wrote into a directory that is not a run"


def _report_on_empty_dir(ctx) -> int:
    (ctx.tmp / "notarun").mkdir()
    return ds_rlhf(["report", str(ctx.tmp / "notarun"), "--no-doctor"])


def _exit_status(*argv: str) -> int:
    """A command's exit status as the shell sees it (a training command ends with `sys.exit("error: ...")`: Python
    prints the message on stderr and exits 1)."""
    try:
        return ds_rlhf(list(argv))
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        return exc.code


# ---- the table ------------------------------------------------------------------------------------------------------
FAULTS = [
    # deep JSON: one row of a prep, the tool-call parser
    Fault("prep/deep-json-row-is-skipped", lambda c: _prep(c, _jsonl(c, GOOD, '{"prompt": ' + DEEP + "}")),
          code=0, left=_dropped("too_deep")),
    Fault("prep/deep-json-row-under-fail", lambda c: _prep(c, _jsonl(c, GOOD, DEEP), "--on-error", "fail"),
          "in.jsonl:2: too_deep", code=2, left=_nothing_at("store")),
    Fault("prep/deep-json-array-file", lambda c: _prep(c, _jsonl(c, "[" + DEEP + "]", name="in.json")),
          "too_deep", code=2, left=_nothing_at("store")),
    Fault("tool-call/deep-json", lambda c: parse_tool_calls(f"<tool_call>{DEEP}</tool_call>").error, "nests"),
    Fault("tool-call/deep-arguments", lambda c: parse_tool_calls(
        '<tool_call>{"name": "calc", "arguments": {"x": ' + DEEP + "}}</tool_call>", {"calc": ["x"]}).error, "nests"),
    Fault("tool-call/deep-json-string-arguments", lambda c: parse_tool_calls(
        '<tool_call>{"name": "calc", "arguments": "' + DEEP + '"}</tool_call>', {"calc": ["x"]}).error, "nests"),
    Fault("tool-call/deep-plain-call", lambda c: parse_tool_calls(f"calc({'[' * 150}{']' * 150})", {"calc": ["x"]}
                                                                  ).error, "nests"),
    # small ones of prep: duplicate keys, NUL prompts, a FIFO as input
    Fault("prep/duplicate-key-is-skipped", lambda c: _prep(c, _jsonl(c, GOOD, '{"prompt": "a", "prompt": "b"}')),
          code=0, left=_dropped("duplicate_key")),
    Fault("prep/duplicate-key-under-fail", lambda c: _prep(c, _jsonl(c, '{"prompt": "a", "prompt": "b"}'),
                                                           "--on-error", "fail"),
          "in.jsonl:1: duplicate_key: key 'prompt' appears more than once", code=2, left=_nothing_at("store")),
    Fault("prep/nul-only-prompt-is-skipped", lambda c: _prep(c, _jsonl(c, GOOD, '{"prompt": "\\u0000\\u0000"}')),
          code=0, left=_dropped("nul_character")),
    Fault("prep/fifo-input-is-refused", _fifo, "is not a regular file", code=2, left=_nothing_at("store")),
    # checkpoints: handed over with a payload, no room for the first one, the file-size limit at a save
    Fault("checkpoint/pickled-global-refused-at-resolve", _handed_checkpoint,
          "holds the pickled global builtins.exec", raises=CheckpointLoadError, left=_payload_did_not_run),
    Fault("checkpoint/no-room-for-the-first-one-at-start", _no_room_at_start,
          "not enough space for this run's first checkpoint", raises=CheckpointSpaceError),
    Fault("checkpoint/ulimit-f-at-a-save", _save_under_ulimit_f, "file-size limit (ulimit -f: 1.0 MiB)",
          raises=CheckpointSaveError, left=_no_partial_checkpoint),
    # stores and resume
    Fault("store/sft-relabelled-as-prompts", _relabelled, "holds a 'sft' store's columns", raises=StoreFormatError),
    Fault("resume/another-batch-size", _resumed_with_another_batch_size, "batch_size: saved 4 vs now 2",
          raises=USER_ERRORS),
    Fault("run/ctrl-c-while-starting", _ctrl_c_while_starting, "interrupted (Ctrl-C) at step 2; the newest "
          "checkpoint is", code=130, left=_status_stopped),
    # rewards, conversion, export, report
    Fault("reward/module-changes-directory", _reward_that_changes_directory, left=_cwd_kept),
    Fault("convert-gguf/unsupported-architecture", _unsupported_gguf, "architecture 'fancy_arch' is not one",
          code=2, left=_nothing_at("out")),
    Fault("publish/into-a-symlink", _publish_through_symlink, "published", left=_link_kept),
    Fault("publish/safetensors-get-umask-permissions", _publish_safetensors, "published", left=_mode_0644),
    Fault("report/empty-dir-that-is-not-a-run", _report_on_empty_dir, "is not a run directory", code=2,
          left=_empty_dir_untouched),
    # FP8 rollouts where they cannot run
    Fault("train/fp8-rollouts-on-the-hf-backend", lambda c: _exit_status(
        "train-ppo", "--model.path", str(c.tokenizer), "--rollout.backend", "hf", "--rollout.quantization", "fp8"),
          "rollout.backend=hf generates with the trainer's own model", code=1),
    Fault("train/fp8-scales-without-fp8", lambda c: _exit_status(
        "train-ppo", "--model.path", str(c.tokenizer), "--rollout.fp8_scales", "block"),
          "add --rollout.quantization fp8", code=1),
    # the SM split where it cannot run
    Fault("train/sm-split-on-the-colocated-engine", lambda c: _exit_status(
        "train-ppo", "--model.path", str(c.tokenizer), "--rollout.sm_split", "mps"),
          "it needs --rollout.placement sidecar", code=1),
    Fault("train/sm-split-green", lambda c: _exit_status(
        "train-ppo", "--model.path", str(c.tokenizer), "--rollout.placement", "sidecar", "--rollout.sm_split", "green"),
          "rollout.sm_split=green: ", code=1),
    # earlier rounds' cheap ones
    Fault("prep/missing-input", lambda c: _prep(c, c.tmp / "absent.jsonl"), "does not exist", code=2,
          left=_nothing_at("store")),
    Fault("prep/lone-surrogate-is-skipped", lambda c: _prep(c, _jsonl(c, GOOD, '{"prompt": "a\\ud800b"}')),
          code=0, left=_dropped("bad_encoding")),
    Fault("report/missing-dir", lambda c: ds_rlhf(["report", str(c.tmp / "absent")]), "does not exist", code=2,
          left=_nothing_at("absent")),
    Fault("convert-gguf/not-a-gguf-file", lambda c: (c.tmp / "m.gguf").write_text("text") and ds_rlhf(
        ["convert-gguf", str(c.tmp / "m.gguf"), str(c.tmp / "out")]), "is not a GGUF file", code=2,
          left=_nothing_at("out")),
]


@pytest.fixture
def ctx(tmp_path, tiny_model_path, monkeypatch):
    return SimpleNamespace(tmp=tmp_path, tokenizer=tiny_model_path, monkeypatch=monkeypatch)


@pytest.mark.timeout(120)  # a row that blocks (a FIFO read, a hang) fails instead of stalling the suite
@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_fault(fault: Fault, ctx, capsys):
    if fault.raises:
        with pytest.raises(fault.raises) as info:
            fault.act(ctx)
        message = str(info.value)
        assert fault.expect in message and "\n" not in message.strip(), message
    elif fault.code is not None:
        code = fault.act(ctx)
        err = capsys.readouterr().err
        assert "Traceback" not in err, err[-3000:]
        assert code == fault.code, err[-3000:]
        if fault.expect:
            lines = [line for line in err.splitlines() if "error:" in line]
            assert len(lines) == 1 and fault.expect in lines[0], err[-3000:]
    else:
        answer = fault.act(ctx)
        assert fault.expect in str(answer), answer
    if fault.left is not None:
        fault.left(ctx)
