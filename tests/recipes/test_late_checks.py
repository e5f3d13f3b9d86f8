"""Checks made before anything loads: the RL context against the model's, the stores opened (and so verified), the
checkpoint to resume verified before any model is built; and `data.max_len` applied to SFT and RM rows."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from transformers import AutoTokenizer

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.data.store import open_store, tokenizer_fingerprint
from ds_rlhf.data.writer import write_store
from ds_rlhf.recipes import rl_build
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.sft import SFTTask
from ds_rlhf.recipes.supervised import SupervisedTrainer, drop_long, longest_sequence
from ds_rlhf.run.checkpoint.manager import CheckpointCorrupt
from ds_rlhf.run.preflight import check_rl_run
from tests.recipes.stores import prompt_store, rl_config

SHORT, LONG, MAX_LEN = 24, 100, 64


# ---- the RL context against the model's ------------------------------------------------------------------------
def test_rollout_context_past_the_models_is_refused_naming_the_sum(tmp_path, tiny_model_path):
    train = prompt_store(tmp_path, tiny_model_path)
    model = ["--model.path", str(tiny_model_path)]
    with pytest.raises(ConfigError, match=r"data\.max_prompt_len \+ rollout\.max_new_tokens = 400 \+ 128 = 528 tokens "
                                          r"exceed the context of model\.path=.*max_position_embeddings=512"):
        check_rl_run(rl_config(tmp_path, train, *model, "--data.max_prompt_len", "400"))
    with pytest.raises(ConfigError, match=r"rollout\.max_model_len=600 tokens exceed .*max_position_embeddings=512"):
        check_rl_run(rl_config(tmp_path, train, *model, "--rollout.max_model_len", "600"))
    # `tiny` (the default model.path) is resolved, so built, and checked the same way
    with pytest.raises(ConfigError, match=r"= 528 tokens exceed the context of model\.path='tiny'"):
        check_rl_run(rl_config(tmp_path, train, "--data.max_prompt_len", "400"))
    check_rl_run(rl_config(tmp_path, train, *model, "--data.max_prompt_len", "384"))  # 384 + 128 = 512 fits


def test_a_manifest_that_understates_the_prompts_is_refused_by_preflight(tmp_path, tiny_model_path):
    train = prompt_store(tmp_path, tiny_model_path, lengths=(4, 40, 6))
    manifest = json.loads((train / "manifest.json").read_text())
    manifest["token_stats"] = {"input_ids": {"rows": 3, "min": 4, "max": 8, "total": 50}}  # the data: max 40
    (train / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"data\.train=.*says input_ids max 8 but .*lengths.npy holds 40"):
        check_rl_run(rl_config(tmp_path, train, "--data.max_prompt_len", "32"))


# ---- data.max_len in SFT and RM ---------------------------------------------------------------------------------
def _fingerprint(tiny_model_path) -> str:
    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model_path))


def sft_store(tmp_path, tiny_model_path, lengths):
    rows = [{"input_ids": list(range(3, 3 + n)), "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)} for n in lengths]
    return write_store(tmp_path / "sft", "sft", rows, tokenizer_name=str(tiny_model_path),
                       tokenizer_fingerprint=_fingerprint(tiny_model_path))


@pytest.fixture(scope="module")
def long_row_run(tiny_model_path, tmp_path_factory, dist_single):
    """One SFT step on 8 short rows and 2 longer than data.max_len; the run keeps its checkpoint."""
    tmp = tmp_path_factory.mktemp("late_sft")
    store = sft_store(tmp, tiny_model_path, [SHORT] * 4 + [LONG] + [SHORT] * 4 + [LONG])
    argv = ["--model.path", str(tiny_model_path), "--data.train", str(store), "--data.max_len", str(MAX_LEN),
            "--data.eval_fraction", "0", "--optim.batch_size", "4", "--run.steps", "1",
            "--run.output_dir", str(tmp / "run"), "--run.progress", "false"]
    trainer = SupervisedTrainer(parse_config(argv), SFTTask())
    served = np.concatenate([trainer.loader.epoch_indices(e) for e in range(2)])
    trainer.train()
    metrics = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"store": store, "run": tmp / "run", "served": served, "metrics": metrics, "argv": argv, "tmp": tmp}


def test_sft_rows_longer_than_max_len_are_dropped_and_counted(long_row_run):
    with open_store(long_row_run["store"]) as store:
        lengths = store.lengths
    served = long_row_run["served"]
    assert len(served) == 16 and set(served) == {0, 1, 2, 3, 5, 6, 7, 8}  # two epochs; rows 4 and 9 are long
    assert (lengths[served] <= MAX_LEN).all()
    step = next(m for m in long_row_run["metrics"] if "data/dropped_long" in m)
    assert step["data/dropped_long"] == 2


def test_sft_start_line_says_how_many_rows_max_len_drops(tiny_model_path, tmp_path, dist_single, capsys):
    store = sft_store(tmp_path, tiny_model_path, [SHORT] * 4 + [LONG] * 3)
    SupervisedTrainer(parse_config(["--model.path", str(tiny_model_path), "--data.train", str(store),
                                    "--data.max_len", str(MAX_LEN), "--data.eval_fraction", "0",
                                    "--optim.batch_size", "4", "--run.steps", "1",
                                    "--run.output_dir", str(tmp_path / "run")]), SFTTask())
    assert f"[sft] data.max_len={MAX_LEN}: dropped 3 row(s) longer than it (3 of data.train)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"data\.max_len=16: every training row of data\.train=.* is longer \(the "
                                          r"shortest has 24 tokens\)"):
        SupervisedTrainer(parse_config(["--model.path", str(tiny_model_path), "--data.train", str(store),
                                        "--data.max_len", "16", "--run.output_dir", str(tmp_path / "run2")]),
                          SFTTask())


def test_a_preference_pair_is_as_long_as_its_longer_sequence(tmp_path, tiny_model_path):
    pairs = [(10, 12), (10, LONG), (LONG, 10), (30, 20)]
    rows = [{"chosen_ids": list(range(3, 3 + c)), "rejected_ids": list(range(3, 3 + r))} for c, r in pairs]
    path = write_store(tmp_path / "pref", "preference", rows, tokenizer_name=str(tiny_model_path),
                       tokenizer_fingerprint=_fingerprint(tiny_model_path))
    with open_store(path) as store:
        longest = longest_sequence(store)
    assert longest.tolist() == [12, LONG, LONG, 30]
    assert drop_long(range(4), longest, MAX_LEN) == [0, 3]  # each sequence against the limit, not their sum


# ---- the checkpoint to resume is verified before any model loads ------------------------------------------------
def _corrupt_copy(long_row_run, name: str):
    """A copy of the run with one byte of its checkpoint's largest file flipped."""
    run = long_row_run["tmp"] / name
    shutil.copytree(long_row_run["run"], run)
    ckpt = run / "checkpoints" / "step_00000001"
    victim = max((p for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return run, victim


class RecordingSFTTask(SFTTask):
    built = 0

    def build(self, ctx, ds_config):
        type(self).built += 1
        return super().build(ctx, ds_config)


def test_sft_resume_refuses_a_corrupt_checkpoint_before_building_the_model(long_row_run):
    run, victim = _corrupt_copy(long_row_run, "sft_corrupt")
    argv = [a if a != str(long_row_run["run"]) else str(run) for a in long_row_run["argv"]]
    RecordingSFTTask.built = 0
    with pytest.raises(CheckpointCorrupt, match=f"{victim}: sha256 differs"):
        SupervisedTrainer(parse_config([*argv, "--run.resume", "latest", "--run.steps", "2"]), RecordingSFTTask())
    assert RecordingSFTTask.built == 0


def test_rl_resume_refuses_a_corrupt_checkpoint_before_building_the_models(long_row_run, tiny_model_path,
                                                                           monkeypatch):
    run, victim = _corrupt_copy(long_row_run, "rl_corrupt")
    train = prompt_store(long_row_run["tmp"], tiny_model_path, "rl_prompts")
    calls = []
    real = rl_build.build_parts
    monkeypatch.setattr(rl_build, "build_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = parse_config(["--model.path", str(tiny_model_path), "--data.train", str(train), "--reward.fn", "gsm8k",
                        "--rollout.backend", "hf", "--run.output_dir", str(run), "--run.resume", "latest",
                        "--run.steps", "2"])
    with pytest.raises(CheckpointCorrupt, match=f"{victim}: sha256 differs"):
        RLTrainer(cfg)
    assert calls == []
