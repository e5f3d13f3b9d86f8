"""Each training command reads only the sections its trainer reads: another trainer's setting, on the command line
or in a --config file, is one `error:` line naming the command that reads it, and --help lists only its sections."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds_rlhf.config_keys import RECIPES

ROOT = Path(__file__).resolve().parents[2]
ALL_SECTIONS = ("model", "data", "optim", "rollout", "rl", "reward", "critic", "eval", "env", "dpo", "run")


@pytest.mark.parametrize("command, argv, key, reader", [
    ("train-ppo", ["--dpo.beta", "0.1"], "dpo.beta", "train-dpo"),
    ("train-ppo", ["--dpo.loss", "ipo"], "dpo.loss", "train-dpo"),
    ("train-dpo", ["--rl.kl_coef", "0.1"], "rl.kl_coef", "train-ppo"),
    ("train-dpo", ["--kl_coef", "0.1"], "rl.kl_coef", "train-ppo"),  # a bare key of another trainer's section
    ("train-dpo", ["--rollout.max_new_tokens", "64"], "rollout.max_new_tokens", "train-ppo"),
    ("train-sft", ["--rl.kl_coef", "0.1"], "rl.kl_coef", "train-ppo"),
    ("train-sft", ["--dpo.beta", "0.1"], "dpo.beta", "train-dpo"),
    ("train-rm", ["--rollout.n_samples", "8"], "rollout.n_samples", "train-ppo"),
    ("train-rm", ["--reward.fn", "gsm8k"], "reward.fn", "train-ppo"),
])
def test_another_trainers_setting_is_one_error_naming_its_trainer(train_command, command, argv, key, reader):
    with pytest.raises(SystemExit) as exc:
        train_command(command, argv)
    assert str(exc.value.code) == f"error: {key} is a setting of {reader}; {command} does not read it"


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_another_trainers_setting_in_a_config_file_is_refused(train_command, tmp_path, suffix):
    path = tmp_path / f"run.{suffix}"
    data = {"optim": {"lr": 1e-5}, "dpo": {"beta": 0.04}}
    path.write_text(json.dumps(data) if suffix == "json" else "optim:\n  lr: 1.0e-5\ndpo:\n  beta: 0.04\n")
    with pytest.raises(SystemExit) as exc:
        train_command("train-ppo", ["--config", str(path)])
    assert str(exc.value.code) == f"error: {path}: dpo.beta is a setting of train-dpo; train-ppo does not read it"
    (tmp_path / "rl.yaml").write_text("rl:\n  kl_coef: 0.1\n")
    with pytest.raises(SystemExit, match="rl.kl_coef is a setting of train-ppo; train-sft does not read it"):
        train_command("train-sft", ["--config", str(tmp_path / "rl.yaml")])


@pytest.mark.parametrize("command, argv, check", [
    ("train-ppo", ["--rl.kl_coef", "0.05", "--rollout.n_samples", "8"],
     lambda c: c.rl.kl_coef == 0.05 and c.rollout.n_samples == 8),
    ("train-dpo", ["--dpo.beta", "0.2", "--beta", "0.3"], lambda c: c.dpo.beta == 0.3),
    ("train-rm", ["--optim.rm_margin", "0.5", "--model.lora_rank", "8"], lambda c: c.optim.rm_margin == 0.5),
    ("train-sft", ["--data.max_len", "64", "--zero_stage", "2"], lambda c: c.data.max_len == 64),
])
def test_each_command_takes_its_own_sections(train_command, command, argv, check):
    assert check(train_command(command, argv))


@pytest.mark.parametrize("command", list(RECIPES))
def test_help_lists_only_the_sections_the_command_reads(train_command, capsys, command):
    assert train_command(command, ["--help"]) is None
    text = capsys.readouterr().out.split("The settings of this command")[1]  # the doc may name other commands
    listed = re.findall(r"^\[(\w+)\]$", text, flags=re.MULTILINE)
    assert listed == [s for s in ALL_SECTIONS if s in RECIPES[command]]
    for section in set(ALL_SECTIONS) - set(RECIPES[command]):
        assert f"--{section}." not in text
    assert "--ds_config" in text and "--run.output_dir" in text


def _reads(path: Path, section: str) -> bool:
    return re.search(rf"\bcfg\.{section}\b", path.read_text()) is not None


def test_the_table_matches_what_the_recipes_read():
    """The supervised recipes (SFT, RM, DPO) never read the rollout or RL sections and the RL recipe never reads
    the DPO section; each recipe's own section is read by its code."""
    recipes = ROOT / "ds_rlhf" / "recipes"
    supervised = [recipes / f"{name}.py" for name in ("supervised", "sft", "rm", "dpo")]
    rl = sorted(p for p in recipes.glob("*.py") if p not in supervised)
    assert not [p.name for p in supervised for s in ("rl", "rollout") if _reads(p, s)]
    assert not [p.name for p in rl if _reads(p, "dpo")]
    assert _reads(recipes / "rl.py", "rl") and _reads(recipes / "rl_build.py", "rollout")
    assert _reads(ROOT / "ds_rlhf" / "entrypoints" / "train.py", "dpo")  # DPOTask(cfg.dpo)
    assert "dpo" not in RECIPES["train-ppo"] and {"rl", "rollout"}.isdisjoint(RECIPES["train-sft"])
