"""Checkpoints under misuse and failure: nothing lost, nothing silent.

Unit level: CheckpointManager with small fake engines (DeepSpeed's save/load interface over torch.save,
fake_checkpoints.py). The run directory itself (an old run's directory, two runs on one, a bad resume path):
test_run_dir_safety.py.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_rlhf.run.checkpoint.manager import CheckpointManager
from tests.run.fake_checkpoints import FakeEngine, checkpoint_manager, checkpoint_names, save_steps, trainer_state


# ---- 1: a fresh run in an old run's directory -------------------------------------------------------------------
def test_1_prune_never_deletes_the_checkpoint_just_saved(tmp_path):
    mgr = save_steps(tmp_path, [7, 8])
    mgr.save(1, {"actor": FakeEngine(seed=1)}, trainer_state(1))
    assert "step_00000001" in checkpoint_names(mgr)
    assert len(checkpoint_names(mgr)) == 2


# ---- 2: keep_last -------------------------------------------------------------------------------------------------
def test_2_keep_last_zero_keeps_every_checkpoint(tmp_path):
    mgr = save_steps(tmp_path, [1, 2, 3], keep_last=0)
    assert checkpoint_names(mgr) == ["step_00000001", "step_00000002", "step_00000003"]


@pytest.mark.parametrize("keep", [1, 2])
def test_2_keep_last_keeps_that_many_newest(tmp_path, keep):
    mgr = save_steps(tmp_path, [1, 2, 3], keep_last=keep)
    assert checkpoint_names(mgr) == [f"step_0000000{s}" for s in range(4 - keep, 4)]


def test_2_negative_keep_last_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last=-1"):
        CheckpointManager(tmp_path, keep_last=-1)


# ---- 7 and 12: corrupt, truncated and empty checkpoint files ------------------------------------------------------
def _weights(ckpt: Path) -> Path:
    return ckpt / "actor" / "state" / "model_states.pt"


def test_7_flipped_bytes_in_the_weights_are_reported_naming_the_file(tmp_path):
    mgr = save_steps(tmp_path, [2, 4])
    target = _weights(mgr.latest())
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        chunk = f.read(4096)
        f.seek(target.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    with pytest.raises(Exception, match="model_states.pt: sha256") as info:
        checkpoint_manager(tmp_path).resolve("latest")
    assert "--run.resume_fallback true" in str(info.value)
    with pytest.raises(Exception, match="model_states.pt: sha256"):  # load() checks on its own, too
        checkpoint_manager(tmp_path).load(mgr.latest(), {"actor": FakeEngine(seed=9)})


def test_7_resume_fallback_takes_the_newest_checkpoint_that_verifies(tmp_path):
    mgr = save_steps(tmp_path, [2, 4, 6], keep_last=3)
    _weights(mgr.latest()).write_bytes(b"\0" * _weights(mgr.latest()).stat().st_size)
    logs = []
    fallback = checkpoint_manager(tmp_path, logs, resume_fallback=True)
    chosen = fallback.resolve("latest")
    assert chosen.name == "step_00000004"
    assert any("skipping" in line and "step_00000006" in line and "model_states.pt" in line for line in logs)
    engine = FakeEngine(seed=99)
    state = fallback.load(chosen, {"actor": engine})
    assert state["step"] == 4
    torch.testing.assert_close(engine.module.weight, FakeEngine(seed=4).module.weight)


def test_7_old_format_marker_is_read_as_unverified(tmp_path):
    mgr = save_steps(tmp_path, [3])
    (mgr.latest() / "COMPLETE").write_text("3\n")
    logs = []
    assert checkpoint_manager(tmp_path, logs).resolve("latest") == mgr.latest()
    assert any("unverified" in line for line in logs)


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_12_truncated_or_empty_files_are_named_and_the_previous_checkpoint_is_tried(tmp_path, damage):
    mgr = save_steps(tmp_path, [2, 4])
    target = mgr.latest() / "trainer_state.pt"
    with open(target, "r+b") as f:
        f.truncate(0 if damage == "empty" else target.stat().st_size // 2)
    with pytest.raises(Exception, match="trainer_state.pt: .*(truncated|bytes)"):
        checkpoint_manager(tmp_path).resolve("latest")
    assert checkpoint_manager(tmp_path, resume_fallback=True).resolve("latest").name == "step_00000002"


def test_12_old_format_checkpoint_with_a_truncated_file_is_named(tmp_path):
    mgr = save_steps(tmp_path, [2, 4])
    (mgr.latest() / "COMPLETE").write_text("4\n")
    target = _weights(mgr.latest())
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size - 100)
    with pytest.raises(Exception, match="model_states.pt: truncated"):
        checkpoint_manager(tmp_path).resolve("latest")


def test_12_engine_load_errors_name_the_checkpoint(tmp_path):
    mgr = save_steps(tmp_path, [2])
    engine = FakeEngine(seed=0)
    engine.load_checkpoint = lambda *a, **k: (_ for _ in ()).throw(EOFError("Ran out of input"))
    with pytest.raises(Exception, match=r"cannot load actor from .*step_00000002/actor: Ran out") as info:
        mgr.load(mgr.latest(), {"actor": engine})
    assert isinstance(info.value.__cause__, EOFError)


# ---- 11: disk full ------------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 2 MiB filesystem: a tmpfs when we may mount one, else the free-space probe and the engine's writes are
    faked (an injected ENOSPC). Yields (directory, "tmpfs" | "injected")."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount"):
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", f"tmpfs-{uuid.uuid4().hex[:8]}", str(disk)],
                              capture_output=True)
        mounted = proc.returncode == 0 and os.path.ismount(disk)
    if mounted:
        try:
            yield disk, "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)
        return
    try:
        import ds_rlhf.run.checkpoint.manager as rc

        monkeypatch.setattr(rc, "_free_bytes", lambda path: 2 << 20)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"no tmpfs (not root or mount refused) and no free-space probe to fake: {exc}")
    yield disk, "injected"


def test_11_no_room_for_a_checkpoint_is_refused_up_front(small_disk):
    disk, _ = small_disk
    mgr = CheckpointManager(disk)
    with pytest.raises(OSError) as info:  # 1M parameters: ~16 MB of weights and Adam moments
        mgr.save(1, {"actor": FakeEngine(n=1 << 20)}, trainer_state(1))
    assert info.value.errno == errno.ENOSPC
    assert str(disk / "checkpoints") in str(info.value) and "needed" in str(info.value)
    assert not list((disk / "checkpoints").glob(".tmp_*"))


def test_11_disk_full_during_a_save_reports_enospc_and_keeps_the_previous_checkpoint(small_disk):
    disk, mode = small_disk
    mgr = CheckpointManager(disk)
    first = mgr.save(1, {"actor": FakeEngine(n=1024)}, trainer_state(1))
    # the estimate (from step 1's size) is small; this save writes 4 MB more than it
    big = (FakeEngine(n=1024, blob_bytes=4 << 20) if mode == "tmpfs" else
           FakeEngine(n=1024, fail_with=OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError) as info:
        mgr.save(2, {"actor": big}, trainer_state(2))
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and "no space left on device" in message
    assert ".tmp_step_00000002" in message and str(first) in message
    assert not list((disk / "checkpoints").glob(".tmp_*")) and checkpoint_names(mgr) == ["step_00000001"]
    assert mgr.verify(first) is None  # intact
    assert checkpoint_manager(disk).resolve("latest") == first


# ---- 15: weights_only ---------------------------------------------------------------------------------------------
def test_15_rng_and_trainer_state_load_with_weights_only_and_resume_exactly(tmp_path):
    mgr = CheckpointManager(tmp_path)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # numpy's cached Gaussian is part of its state
    ckpt = mgr.save(5, {"actor": FakeEngine()}, trainer_state(5))
    for name in ("rng_rank0.pt", "trainer_state.pt"):
        torch.load(ckpt / name, weights_only=True)
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    state = mgr.load(ckpt, {"actor": FakeEngine(seed=7)})
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected
    assert state["step"] == 5 and state["loader"]["step"] == 5
    assert torch.equal(state["generator"], trainer_state(5)["generator"])


def test_15_rng_files_of_older_checkpoints_still_load(tmp_path):
    from ds_rlhf.run.checkpoint.rng import set_rng_state

    mgr = save_steps(tmp_path, [1])
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, mgr.latest() / "rng_rank0.pt")  # the numpy tuple, as checkpoints held before
    (mgr.latest() / "COMPLETE").write_text("1\n")
    expected = np.random.standard_normal(2).tolist()
    set_rng_state({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()})
    np.random.seed(0)
    checkpoint_manager(tmp_path).load(mgr.latest(), {"actor": FakeEngine()})
    assert np.random.standard_normal(2).tolist() == expected


def test_15_trainer_state_that_would_not_resume_fails_at_save(tmp_path):
    with pytest.raises(TypeError, match="weights_only"):
        CheckpointManager(tmp_path).save(1, {"actor": FakeEngine()}, {"loader": np.arange(3)})
    assert not CheckpointManager(tmp_path).complete_checkpoints()


# ---- resume: nothing there, a bad path ----------------------------------------------------------------------------
def test_resume_latest_with_nothing_to_resume_says_so(tmp_path):
    logs = []
    assert checkpoint_manager(tmp_path, logs).resolve("latest") is None
    assert logs == [f"[checkpoint] no checkpoint in {tmp_path / 'checkpoints'}: starting fresh"]


# ---- export_hf writes into a temp dir and swaps ------------------------------------------------------------------
def test_export_hf_leaves_the_previous_export_whole_when_it_fails(tiny_model_path, tiny_tokenizer, tmp_path,
                                                                  dist_single):
    from transformers import AutoModelForCausalLM

    from ds_rlhf.engines.hf_export import export_hf

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    out = export_hf(model, tiny_tokenizer, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    class Broken:
        def save_pretrained(self, path):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        export_hf(model, Broken(), out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp dir left
    export_hf(model, tiny_tokenizer, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} != before


def test_prune_and_resave_of_the_same_step_keep_one_copy(tmp_path):
    mgr = save_steps(tmp_path, [2, 4])
    mgr.save(4, {"actor": FakeEngine(seed=44)}, trainer_state(4))  # after a resume from step 4
    assert checkpoint_names(mgr) == ["step_00000002", "step_00000004"]
    assert not [p.name for p in mgr.root.iterdir() if p.name.startswith(".")]
    engine = FakeEngine(seed=0)
    mgr.load(mgr.latest(), {"actor": engine})
    torch.testing.assert_close(engine.module.weight, FakeEngine(seed=44).module.weight)
