"""Abuse of the run's inputs and outputs: a checkpoint handed over by someone else must not run code, and nothing the
user owns is deleted (run directories, `ds-rlhf export` targets, prep outputs).

Checkpoints here are real: a tiny SFT run at ZeRO-2 (its optimizer partitions hold DeepSpeed's own pickled types).
A payload is an object whose unpickling runs `exec`, which would create a marker file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.data import open_store, prep_core
from ds_rlhf.data.formats import DataPrepError
from ds_rlhf.data.prep import prep_sft
from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.engines.weights_only import DEEPSPEED_TYPES, load_torch_file
from ds_rlhf.entrypoints.main import main as ds_rlhf
from ds_rlhf.recipes.sft import SFTTask
from ds_rlhf.recipes.supervised import SupervisedTrainer
from ds_rlhf.run.checkpoint.files import MARKER, hash_file
from ds_rlhf.run.context import setup_run
from ds_rlhf.run.run_dir import RunDirError, foreign_entries

ROOT = Path(__file__).resolve().parents[2]
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class Payload:
    """Unpickling this runs `exec`, which writes `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _sft_args(model, store, out, *extra):
    return ["--model.path", str(model), "--data.train", str(store), "--data.eval_fraction", "0",
            "--run.output_dir", str(out), "--run.steps", "2", "--run.save_every", "2", "--optim.batch_size", "8",
            "--optim.micro_batch_size", "8", "--run.progress", "false", "--run.tensorboard", "false",
            "--run.export_hf", "false", "--zero_stage", "2", *extra]


@pytest.fixture(scope="module")
def sft_store(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("abuse_data")
    return write_addition_datasets(out, tiny_model_path, n_prompts=16, n_sft=64, n_pref=16, seed=0,
                                   max_operand=20)["sft"]


@pytest.fixture(scope="module")
def zero2_checkpoint(tiny_model_path, sft_store, tmp_path_factory, dist_single):
    """A run directory with one complete ZeRO-2 checkpoint (step 2) of a 2-step SFT run."""
    run = tmp_path_factory.mktemp("abuse_run") / "run"
    SupervisedTrainer(parse_config(_sft_args(tiny_model_path, sft_store, run)), SFTTask()).train()
    step = run / "checkpoints" / "step_00000002"
    assert (step / MARKER).is_file() and (step / "sft" / "state" / OPTIM).is_file()
    return run


def _tampered_copy(run: Path, dest: Path, file_name: str, marker: Path) -> Path:
    """A copy of `run` whose checkpoint file `file_name` carries a Payload, with the COMPLETE manifest recomputed
    as the trainer writes it (so the sha256 check passes); returns the step directory."""
    shutil.copytree(run, dest)
    step = dest / "checkpoints" / "step_00000002"
    target = step / "sft" / "state" / file_name
    state = torch.load(target, map_location="cpu", weights_only=False)  # our own fresh file
    state["payload"] = Payload(marker)
    torch.save(state, target)
    manifest = json.loads((step / MARKER).read_text())
    rel = target.relative_to(step).as_posix()
    size, digest = hash_file(target)
    manifest["files"][rel] = {"size": size, "sha256": digest}
    (step / MARKER).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return step


def _one_line_naming(text: str, path: Path) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    refusals = [line for line in lines if "holds the pickled global" in line]
    assert len(refusals) == 1, text[-3000:]
    assert str(path) in refusals[0] and "exec" in refusals[0], refusals[0]
    assert "Traceback" not in text, text[-3000:]
    return refusals[0]


def test_1_clean_deepspeed_files_load_weights_only(zero2_checkpoint):
    """The allow-list covers what DeepSpeed writes: every file of a real ZeRO-2 checkpoint loads weights-only."""
    state_dir = zero2_checkpoint / "checkpoints" / "step_00000002" / "sft" / "state"
    optim = load_torch_file(state_dir / OPTIM)
    assert type(optim["optimizer_state_dict"]["zero_stage"]).__module__ + ".ZeroStageEnum" in DEEPSPEED_TYPES
    assert "module" in load_torch_file(state_dir / MODEL)


@pytest.mark.parametrize("file_name", [OPTIM, MODEL])
def test_1_pickle_payload_is_refused_on_export(zero2_checkpoint, tmp_path, capsys, file_name):
    marker = tmp_path / "marker"
    step = _tampered_copy(zero2_checkpoint, tmp_path / "run", file_name, marker)
    assert ds_rlhf(["export", str(step), str(tmp_path / "out")]) == 2
    _one_line_naming(capsys.readouterr().err, step / "sft" / "state" / file_name)
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "out").exists()


def test_1_pickle_payload_is_refused_on_resume(zero2_checkpoint, tiny_model_path, sft_store, tmp_path, capsys):
    marker = tmp_path / "marker"
    step = _tampered_copy(zero2_checkpoint, tmp_path / "handed", OPTIM, marker)
    argv = ["train-sft", *_sft_args(tiny_model_path, sft_store, tmp_path / "resumed", "--run.steps", "4",
                                    "--run.resume", str(step))]
    with pytest.raises(SystemExit) as info:
        ds_rlhf(argv)
    assert info.value.code not in (0, None)
    _one_line_naming(str(info.value.code), step / "sft" / "state" / OPTIM)
    assert not marker.exists(), "the payload ran"



# ---- 3: nothing of the user's is deleted: run directories, export targets, prep outputs -------------------------
def _cfg(model, out, *extra):
    return parse_config(["--model.path", str(model), "--run.output_dir", str(out), "--run.tensorboard", "false",
                         "--run.progress", "false", *extra])


def _earlier_run_with_an_export(run: Path) -> Path:
    """What an earlier run left: export/actor (a model file and the user's notes in it), no checkpoint."""
    actor = run / "export" / "actor"
    actor.mkdir(parents=True)
    (actor / "model.safetensors").write_bytes(b"weights")
    (actor / "NOTES.md").write_text("the user's notes")
    return actor


def test_3_fresh_run_over_an_earlier_export_is_refused(tiny_model_path, dist_single, tmp_path):
    actor = _earlier_run_with_an_export(tmp_path / "run")
    with pytest.raises(RunDirError) as info:
        setup_run(_cfg(tiny_model_path, tmp_path / "run"), "rl")
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "run" / "export") in message and "--run.overwrite" in message
    assert (actor / "NOTES.md").read_text() == "the user's notes"
    assert not (tmp_path / "run" / "config.json").exists()  # nothing written


def test_3_overwrite_moves_an_earlier_export_aside(tiny_model_path, dist_single, tmp_path, capsys):
    run = tmp_path / "run"
    _earlier_run_with_an_export(run)
    ctx = setup_run(_cfg(tiny_model_path, run, "--run.overwrite", "true"), "rl")
    ctx.close()
    assert not (run / "export").exists()  # the new run's export goes there
    [aside] = run.glob("export.before-*")
    assert (aside / "actor" / "NOTES.md").read_text() == "the user's notes"
    assert f"moved the earlier run's {run / 'export'} aside to {aside.name}" in capsys.readouterr().out


def test_3_fresh_run_into_a_directory_of_other_files(tiny_model_path, dist_single, tmp_path):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="holds files a run does not write") as info:
        setup_run(_cfg(tiny_model_path, run), "rl")
    assert "data, notes.txt" in str(info.value) and "\n" not in str(info.value)
    # --run.overwrite runs there and deletes only what a run wrote: the earlier checkpoints, not other files
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / MARKER).write_text("3")
    (run / "checkpoints" / "README").write_text("mine too")
    ctx = setup_run(_cfg(tiny_model_path, run, "--run.overwrite", "true"), "rl")
    ctx.close()
    assert (run / "notes.txt").read_text() == "mine" and (run / "data" / "train.jsonl").is_file()
    assert not (run / "checkpoints" / "step_00000003").exists()
    assert (run / "checkpoints" / "README").read_text() == "mine too"


def test_3_what_a_run_writes_is_not_foreign(zero2_checkpoint):
    """A real run's directory holds only names `RUN_FILES` lists: the fresh-run check never calls them foreign."""
    names = {p.name for p in zero2_checkpoint.iterdir()}
    assert {"config.json", "metrics.jsonl", "checkpoints", "status.json"} <= names
    assert foreign_entries(zero2_checkpoint) == []


def test_3_empty_output_dir_is_refused(tiny_model_path, dist_single, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"mine": true}')
    with pytest.raises(RunDirError, match=r"--run.output_dir is empty"):
        setup_run(_cfg(tiny_model_path, ""), "rl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert json.loads((tmp_path / "config.json").read_text()) == {"mine": True}


def test_3_export_onto_an_existing_file_or_directory_needs_overwrite(zero2_checkpoint, tmp_path, capsys):
    step = zero2_checkpoint / "checkpoints" / "step_00000002"
    target = tmp_path / "model.bin"
    target.write_bytes(b"the user's file")
    assert ds_rlhf(["export", str(step), str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ds-rlhf export: {target} is an existing file: pass another OUT_DIR, or --overwrite to replace it"
    assert target.read_bytes() == b"the user's file"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "NOTES.md").write_text("mine")
    assert ds_rlhf(["export", str(step), str(folder)]) == 2
    assert "is a non-empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.bin"] and (folder / "NOTES.md").is_file()
    assert ds_rlhf(["export", str(step), str(folder), "--overwrite"]) == 0
    assert (folder / "model.safetensors").is_file() and not (folder / "NOTES.md").exists()
    (tmp_path / "empty").mkdir()
    assert ds_rlhf(["export", str(step), str(tmp_path / "empty")]) == 0  # an empty directory is fine


HOLD_PREP_LOCK = """
import sys, time
from pathlib import Path
from ds_rlhf.data.prep_core import lock_output
with lock_output(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def _sft_jsonl(path: Path, n: int, tag: str) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{tag} {i}?", "response": f"{tag} answer {i}"}) + "\n"
                            for i in range(n)))
    return path


def test_3_second_prep_into_the_same_output_is_refused(tiny_tokenizer, tmp_path, monkeypatch):
    """Two preps into one output: the one that comes second is refused, in another process or in this one, and the
    first one's rows are all in the store."""
    out = tmp_path / "stores" / "sft"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_PREP_LOCK, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        line = holder.stdout.readline()
        assert "locked" in line, line + holder.stdout.read()
        with pytest.raises(DataPrepError, match=rf"is being written by another prep \(pid {holder.pid}, host"):
            prep_sft(_sft_jsonl(tmp_path / "b.jsonl", 5, "b"), out, tiny_tokenizer, progress=False)
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # in one process: a prep that starts while another is writing its rows
    second = []
    write_rows = prep_core._write_rows

    def rows_then_a_second_prep(*args, **kwargs):
        report = write_rows(*args, **kwargs)
        try:
            prep_sft(_sft_jsonl(tmp_path / "b.jsonl", 5, "b"), out, tiny_tokenizer, progress=False)
        except DataPrepError as exc:
            second.append(str(exc))
        return report

    monkeypatch.setattr(prep_core, "_write_rows", rows_then_a_second_prep)
    result = prep_sft(_sft_jsonl(tmp_path / "a.jsonl", 40, "a"), out, tiny_tokenizer, progress=False)
    assert len(second) == 1 and "is being written by another prep" in second[0], second
    assert result.manifest["rows"] == 40 and len(open_store(out)) == 40
    assert sorted(p.name for p in out.parent.iterdir()) == ["sft"]  # no lock file or temp dir left


# ---- 4: a damaged store stops a run with one line -----------------------------------------------------------------
def test_4_training_on_a_damaged_store_stops_in_one_line(tiny_model_path, sft_store, tmp_path, dist_single):
    store = tmp_path / "sft"
    shutil.copytree(sft_store, store)
    data = store / "data-00000.arrow"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 2048] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 2048])
    data.write_bytes(bytes(raw))
    with pytest.raises(SystemExit) as info:
        ds_rlhf(["train-sft", *_sft_args(tiny_model_path, store, tmp_path / "run")])
    # refused by preflight, before any model loads, naming the setting, the store and the damaged file
    assert info.value.code == f"error: data.train={str(store)!r}: store {store}: {data} has another sha256 than when " \
                              "it was written (the file is corrupt or was modified; re-run data prep)"
