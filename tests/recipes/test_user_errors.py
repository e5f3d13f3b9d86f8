"""User errors are one line naming the input and what to change, at parse time where the value alone decides it;
a real bug still shows its traceback; --debug / DS_RLHF_DEBUG=1 shows the traceback of a user error too."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import subprocess
import sys
import time
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ds_rlhf.cli import run_entry
from ds_rlhf.config import Config, load_file, parse_config, validate
from ds_rlhf.data.formats import DataPrepError
from ds_rlhf.data.loader import StoreLoader
from ds_rlhf.data.prep import prep_gsm8k, prep_prompts, prep_sft
from ds_rlhf.data.store import StoreMismatchError
from ds_rlhf.data.writer import write_store
from ds_rlhf.engines.ds_config import pick_precision, resolve_ds_config
from ds_rlhf.engines.models import load_causal_lm
from ds_rlhf.errors import ConfigError, UserInputError
from ds_rlhf.recipes.rollout_precision import check_rollout_precision
from ds_rlhf.rollout.vllm_adapter import vllm_version
from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.stores import prompt_store

ROOT = Path(__file__).resolve().parents[2]


def float_keys() -> list[str]:
    """Every float setting of the schema (section.key), found from the dataclasses' type hints."""
    keys = []
    for section, typ in typing.get_type_hints(Config).items():
        if dataclasses.is_dataclass(typ):
            keys += [f"{section}.{name}" for name, hint in typing.get_type_hints(typ).items() if hint is float]
    return keys


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=clean_env(**(env or {})))
    return proc, time.monotonic() - start


# ---- 6: values that pass the range rules but cannot work, refused at parse time ----------------------------------
def test_the_schema_has_float_settings_to_check():
    assert {"optim.lr", "rollout.temperature", "rl.kl_coef", "optim.rm_margin"} <= set(float_keys())


@pytest.mark.parametrize("key", float_keys())
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_setting_refuses_non_finite_values(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}={value}: must be a finite number"):
        parse_config([f"--{key}", value])


def test_non_finite_values_from_a_yaml_file_or_code_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temperature: .inf\n")
    with pytest.raises(ConfigError, match=r"rollout.temperature=inf: must be a finite number"):
        parse_config(["--config", str(path)])
    cfg = Config()
    cfg.optim.betas = (0.9, float("nan"))
    with pytest.raises(ConfigError, match=r"optim.betas=\(0.9, nan\): must be a finite number"):
        validate(cfg)


@pytest.mark.parametrize("betas, why", [("0.9,2", "each value must be < 1"), ("0.9,1", "each value must be < 1"),
                                        ("-0.1,0.9", "each value must be >= 0")])
def test_betas_outside_zero_one_are_refused(betas, why):
    with pytest.raises(ConfigError, match=rf"optim.betas=.*: {why}"):
        parse_config(["--optim.betas", betas])
    assert parse_config(["--optim.betas", "0,0.999"]).optim.betas == (0.0, 0.999)


def test_seeds_outside_numpys_range_are_refused_and_its_largest_works():
    for seed, why in ((2**63, "<= 4294967295"), (2**32, "<= 4294967295"), (-1, ">= 0")):
        with pytest.raises(ConfigError, match=rf"run.seed={seed}: must be {why}"):
            parse_config(["--run.seed", str(seed)])
    with pytest.raises(ValueError):  # the limit is numpy's (seed_everything, vLLM's engine seed)
        np.random.seed(2**32)
    np.random.seed(parse_config(["--run.seed", str(2**32 - 1)]).run.seed)


def test_an_int_overflowing_to_infinity_is_a_config_error():
    with pytest.raises(ConfigError, match=r"bad value '1e400' for 'run.steps'"):
        parse_config(["--run.steps", "1e400"])


def test_unknown_dtype_is_refused_at_parse_time():
    with pytest.raises(ConfigError, match=r"model.dtype='bfloat16': choose one of auto, fp32, bf16, fp16"):
        parse_config(["--model.dtype", "bfloat16"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rules")
def test_fp16_on_cpu_names_the_setting():
    with pytest.raises(ConfigError, match=r"model.dtype=fp16 needs a GPU.*--model.dtype fp32"):
        pick_precision("fp16")


@pytest.mark.skipif(vllm_version() is None, reason="vLLM is not importable here")
def test_bf16_with_vllm_on_cpu_is_refused_before_any_model_is_built():
    ctx = SimpleNamespace(dist=SimpleNamespace(device=torch.device("cpu")), precision="bf16")
    refusal = r"model.dtype=bf16 \(bf16, .*\) with the vLLM rollout on CPU.*--rollout.backend"
    with pytest.raises(ConfigError, match=refusal):
        check_rollout_precision(parse_config(["--model.dtype", "bf16", "--rollout.backend", "vllm"]), ctx)
    check_rollout_precision(parse_config(["--model.dtype", "bf16", "--rollout.backend", "hf"]), ctx)
    check_rollout_precision(parse_config(["--rollout.backend", "vllm"]), SimpleNamespace(
        dist=SimpleNamespace(device=torch.device("cpu")), precision="fp32"))


def test_the_command_line_refuses_an_infinite_lr_in_one_line_within_seconds():
    proc, seconds = cli("train-ppo", "--optim.lr", "inf", "--rollout.temperature", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "error: optim.lr=inf: must be a finite number (not inf or nan)"
    assert "Traceback" not in proc.stderr
    assert seconds < 30  # parse time: no model, store or process group (a few seconds, more on a busy CPU)


# ---- 7: user errors are one line; a bug keeps its traceback; --debug shows it --------------------------------------
def _raiser(exc):
    def run(cfg):
        raise exc
    return run


def test_a_user_error_is_one_line_and_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv("DS_RLHF_DEBUG", raising=False)
    for exc in (UserInputError("data.train='x': no such directory"), StoreMismatchError("x was tokenized with y")):
        with pytest.raises(SystemExit) as info:
            run_entry("doc", {}, _raiser(exc), [])
        assert info.value.code == f"error: {exc}"
    with pytest.raises(KeyError):  # not a user error: the traceback stays
        run_entry("doc", {}, _raiser(KeyError("actor")), [])


def test_debug_flag_or_env_shows_the_traceback_of_a_user_error(monkeypatch):
    monkeypatch.delenv("DS_RLHF_DEBUG", raising=False)
    seen = []
    with pytest.raises(ConfigError):
        run_entry("doc", {}, lambda cfg: seen.append(cfg) or (_ for _ in ()).throw(ConfigError("bad")), ["--debug"])
    assert isinstance(seen[0], Config)  # --debug is the CLI's flag, not a config key
    monkeypatch.setenv("DS_RLHF_DEBUG", "1")
    with pytest.raises(UserInputError):
        run_entry("doc", {}, _raiser(UserInputError("bad")), [])
    monkeypatch.setenv("DS_RLHF_DEBUG", "0")
    with pytest.raises(SystemExit):
        run_entry("doc", {}, _raiser(UserInputError("bad")), [])


def test_a_full_disk_or_unwritable_path_is_one_line_naming_it(monkeypatch, tmp_path):
    monkeypatch.delenv("DS_RLHF_DEBUG", raising=False)
    out = str(tmp_path / "run")
    cases = [(OSError(errno.ENOSPC, "No space left on device", f"{out}/metrics.jsonl"),
              f"error: {out}/metrics.jsonl: No space left on device; free space there or write elsewhere"),
             (OSError(errno.ENOSPC, "No space left on device"),  # a write() names no file: the output dir is named
              f"error: No space left on device (the run writes under run.output_dir={out}); free space there"),
             (PermissionError(errno.EACCES, "Permission denied", "/ro/run"),
              "error: /ro/run: Permission denied; fix its permissions or write elsewhere (e.g. --run.output_dir)")]
    for exc, line in cases:
        with pytest.raises(SystemExit) as info:
            run_entry("doc", {}, _raiser(exc), ["--run.output_dir", out])
        assert info.value.code.startswith(line)
    with pytest.raises(FileNotFoundError):  # a missing file may be a bug: its traceback stays
        run_entry("doc", {}, _raiser(FileNotFoundError(errno.ENOENT, "No such file", "x")), [])
    with pytest.raises(OSError):  # --debug: the traceback
        run_entry("doc", {}, _raiser(cases[0][0]), ["--debug"])


def test_an_output_dir_behind_a_file_is_one_line_on_the_command_line(tiny_model_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc, _ = cli("train-ppo", "--model.path", str(tiny_model_path), "--data.train",
                  str(prompt_store(tmp_path, tiny_model_path)), "--reward.fn", "gsm8k", "--run.output_dir",
                  str(blocker / "run"), "--rollout.backend", "hf")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: run.output_dir='{blocker / 'run'}' cannot be created (Not a directory)"), last


def test_too_few_rows_for_a_batch_names_the_settings(tiny_model_path, tmp_path):
    store = prompt_store(tmp_path, tiny_model_path, lengths=(4, 5, 6))
    with pytest.raises(UserInputError, match=r"3 rows give no batch of 8 .*rl.prompts_per_step .*optim.batch_size"):
        StoreLoader(store, batch_size=8, rank=0, world_size=1, drop_last=True)


def test_a_train_batch_size_conflict_in_the_ds_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"ds_config key 'train_batch_size'=999 != train_micro_batch_size_per_gpu"):
        resolve_ds_config({"train_batch_size": 999}, micro_batch_size=4, grad_accum=1, world_size=1,
                          precision="fp32", grad_clip=1.0, lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                          warmup_steps=0, total_steps=10, zero_stage=2, offload=None)


def test_a_truncated_weight_file_names_the_model_directory(tiny_model_path, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserInputError, match=rf"cannot load the model at {model} \(SafetensorError"):
        load_causal_lm(model, dtype="fp32")


def test_a_tokenizer_mismatch_between_model_and_store_is_one_line_on_the_command_line(tiny_model_path, tmp_path):
    """End to end through `ds-rlhf train-ppo`: a store written for another tokenizer."""
    store = tmp_path / "store"
    write_store(store, "prompts", [{"input_ids": [3, 4, 5], "ground_truth": "1"}] * 4, tokenizer_name="other",
                tokenizer_fingerprint="0" * 64)
    proc, _ = cli("train-ppo", "--model.path", str(tiny_model_path), "--data.train", str(store), "--reward.fn",
                  "gsm8k", "--run.output_dir", str(tmp_path / "run"), "--rollout.backend", "hf", "--run.steps", "1",
                  "--run.progress", "false", "--run.tensorboard", "false")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {store} was tokenized with other") and "Re-run data_prep" in last
    assert "Traceback" not in proc.stderr


def test_a_corrupt_tokenizer_json_names_the_file(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    (model / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(UserInputError, match="tokenizer.json"):
        setup_run(parse_config(["--model.path", str(model), "--run.output_dir", str(tmp_path / "run")]), "rl")


def test_a_model_path_that_is_not_a_model_names_it(dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run

    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "readme.txt").write_text("hi")
    with pytest.raises(UserInputError, match=r"model.path.*notamodel"):
        setup_run(parse_config(["--model.path", str(tmp_path / "notamodel"),
                                "--run.output_dir", str(tmp_path / "run")]), "rl")


def test_an_output_dir_that_cannot_be_written_names_it(tiny_model_path, dist_single, tmp_path):
    from ds_rlhf.run.context import setup_run

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserInputError, match=r"run.output_dir"):
        setup_run(parse_config(["--model.path", str(tiny_model_path), "--run.output_dir", str(blocker / "run")]),
                  "rl")


# ---- 8: one row that is not valid text is one bad row --------------------------------------------------------------
@pytest.mark.parametrize("prep, rows", [
    (prep_prompts, [{"prompt": "a"}, {"prompt": "x\ud800"}, {"prompt": "c"}]),
    (prep_sft, [{"prompt": "a", "response": "b"}, {"prompt": "x", "response": "b\ud800"}, {"prompt": "c",
                                                                                            "response": "d"}]),
    (prep_gsm8k, [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "\udfff #### 2"},
                  {"question": "c", "answer": "#### 3"}]),
])
def test_a_lone_surrogate_is_one_dropped_row_with_its_line(prep, rows, tiny_model_path, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # "\ud800" escapes: valid JSON
    kwargs = {"apply_chat_template": False} if prep is prep_sft else {}
    result = prep(path, tmp_path / "out", str(tiny_model_path), progress=False, on_error="skip", **kwargs)
    assert result.manifest["row_counts"] == {"read": 3, "written": 2, "dropped": 1}
    (dropped,) = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert dropped["where"] == "in.jsonl:2" and dropped["reason"] == "bad_encoding"
    assert "lone surrogate" in dropped["detail"]


def test_a_lone_surrogate_under_on_error_fail_names_the_line(tiny_model_path, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "x\\ud800"}\n')
    with pytest.raises(DataPrepError, match=r"in.jsonl:2: bad_encoding: field 'prompt': lone surrogate"):
        prep_prompts(path, tmp_path / "out", str(tiny_model_path), progress=False, on_error="fail")


# ---- 9: duplicate keys in a --config file ------------------------------------------------------------------------
def test_a_key_given_twice_in_a_yaml_config_is_refused_naming_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1.0e-5\n  warmup_steps: 3\n  lr: 2.0e-5\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: key 'lr' is given twice \(lines 2 and 4\)"):
        parse_config(["--config", str(path)])
    path.write_text("optim:\n  lr: 1.0e-5\nrl:\n  lr_like: 1\n")  # one key per mapping: fine
    assert load_file(path) == {"optim": {"lr": 1.0e-5}, "rl": {"lr_like": 1}}


def test_a_key_given_twice_in_a_json_config_is_refused(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"run": {"steps": 3, "steps": 5}}')
    with pytest.raises(ConfigError, match=rf"config file {path}: key 'steps' is given twice"):
        parse_config(["--config", str(path)])
