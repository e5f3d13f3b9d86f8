"""A setting given on the command line (or in a --config file) and a different explicit value of it in the ds_config
file is one error naming both values (the Hugging Face Trainer's rule); "auto", an equal value, or a setting left at
its default is fine."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def ds_file(tmp_path):
    def write(data: dict) -> str:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **data}))
        return str(path)

    return write


def test_a_given_lr_against_the_files_lr_is_an_error_naming_both(train_command, ds_file):
    path = ds_file({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}})
    with pytest.raises(SystemExit) as exc:
        train_command("train-sft", ["--ds_config", path, "--optim.lr", "2e-5"])
    line = str(exc.value.code)
    assert line.startswith("error: optim.lr=2e-05 is given and the ds_config file sets optimizer.params.lr=1e-05")
    assert path in line and "\n" not in line


def test_a_given_lr_in_a_config_file_counts_as_given(train_command, ds_file, tmp_path):
    path = ds_file({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}})
    (tmp_path / "run.yaml").write_text("optim:\n  lr: 3.0e-5\n")
    with pytest.raises(SystemExit, match="optim.lr=3e-05 is given"):
        train_command("train-ppo", ["--ds_config", path, "--config", str(tmp_path / "run.yaml")])


@pytest.mark.parametrize("file_lr", ["auto", 2e-5])
def test_auto_or_the_same_value_in_the_file_is_fine(train_command, ds_file, file_lr):
    path = ds_file({"optimizer": {"type": "AdamW", "params": {"lr": file_lr}}})
    assert train_command("train-sft", ["--ds_config", path, "--optim.lr", "2e-5"]).optim.lr == 2e-5


def test_a_file_value_with_the_setting_left_at_its_default_is_kept(train_command, ds_file):
    path = ds_file({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "train_micro_batch_size_per_gpu": 2})
    assert train_command("train-sft", ["--ds_config", path]) is not None


@pytest.mark.parametrize("command, file, argv, named", [
    ("train-sft", {"train_micro_batch_size_per_gpu": 2}, ["--optim.micro_batch_size", "4"],
     "optim.micro_batch_size=4 is given and the ds_config file sets train_micro_batch_size_per_gpu=2"),
    ("train-sft", {"gradient_accumulation_steps": 4}, ["--optim.batch_size", "32", "--optim.micro_batch_size", "4"],
     "make gradient_accumulation_steps 8 and the ds_config file sets gradient_accumulation_steps=4"),
    ("train-dpo", {"train_batch_size": 999}, ["--optim.batch_size", "8"],
     "make train_batch_size 8 and the ds_config file sets train_batch_size=999"),
    ("train-ppo", {"gradient_accumulation_steps": 2},
     ["--rl.mini_batch_size", "16", "--optim.micro_batch_size", "4"],
     "make gradient_accumulation_steps 4 and the ds_config file sets gradient_accumulation_steps=2"),
    ("train-rm", {"gradient_clipping": 0.5}, ["--optim.grad_clip", "1.5"],
     "optim.grad_clip=1.5 is given and the ds_config file sets gradient_clipping=0.5"),
    ("train-sft", {"fp16": {"enabled": True}}, ["--model.dtype", "bf16"],
     "model.dtype='bf16' is given and the ds_config file sets fp16.enabled=True"),
])
def test_batch_precision_and_clipping_conflicts(train_command, ds_file, monkeypatch, command, file, argv, named):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        train_command(command, ["--ds_config", ds_file(file), *argv])
    assert named in str(exc.value.code)


def test_consistent_batch_settings_pass(train_command, ds_file, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = ds_file({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "train_batch_size": 16})
    cfg = train_command("train-sft", ["--ds_config", path, "--optim.batch_size", "16", "--optim.micro_batch_size", "4"])
    assert cfg.optim.batch_size == 16
