"""The one config schema: files + overrides, type checking, unknown keys rejected, launcher args accepted."""

from __future__ import annotations

import json

import pytest

from ds_rlhf.config import Config, ConfigError, help_text, load_file, parse_config
from ds_rlhf.ds_config_file import packaged_ds_configs


def test_defaults_file_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  algo: ppo\n  kl_coef: 0.2\noptim:\n  lr: 1.0e-5\nds_config: ds_configs/zero3.json\n")
    cfg = parse_config(["--config", str(path), "--rl.kl_coef", "0.05", "--steps=7"],
                       defaults={"rl": {"algo": "rloo", "gamma": 0.9}})
    assert cfg.rl.algo == "ppo"  # file beats entry-point default
    assert cfg.rl.gamma == 0.9  # entry-point default beats schema default
    assert cfg.rl.kl_coef == 0.05  # command line beats file
    assert cfg.optim.lr == 1e-5 and cfg.run.steps == 7 and cfg.ds_config == "ds_configs/zero3.json"


def test_json_file_and_dotted_keys(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rollout.n_samples": 16, "run": {"seed": 3}}))
    cfg = parse_config(["--config", str(path)])
    assert cfg.rollout.n_samples == 16 and cfg.run.seed == 3


@pytest.mark.parametrize("argv, message", [
    (["--rl.kl_coeff", "1"], "did you mean"),
    (["--no_such_key", "1"], "unknown config key"),
    (["--lr", "fast"], "bad value"),
    (["--steps"], "needs a value"),
    (["--betas", "0.9"], "expected 2"),
    (["--rollout.sleep", "maybe"], "bad value"),
    (["positional"], "unexpected argument"),
])
def test_bad_input_is_an_error_not_ignored(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_unknown_key_in_file_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rl:\n  algorithm: grpo\n")
    with pytest.raises(ConfigError, match="unknown config key 'rl.algorithm'"):
        parse_config(["--config", str(path)])


def test_launcher_arguments_are_accepted():
    cfg = parse_config(["--local_rank=3", "--ds_config", "x.json", "--rollout.sleep", "--betas", "0.9,0.99"])
    assert cfg.local_rank == 3 and cfg.ds_config == "x.json"
    assert cfg.rollout.sleep is True and cfg.optim.betas == (0.9, 0.99)


def test_save_round_trip_and_help(tmp_path):
    cfg = parse_config(["--rl.algo", "ppo"])
    cfg.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["rl"]["algo"] == "ppo"
    text = help_text(Config())
    assert "--rl.kl_coef" in text and "# k1 | k2 | k3" in text


@pytest.mark.parametrize("argv, message", [
    (["--rl.algo", "dpo"], "rl.algo='dpo'"),
    (["--rl.kl_in", "both"], "rl.kl_in"),
    (["--rl.algo", "grpo", "--rollout.n_samples", "1"], "n_samples >= 2"),
    (["--rollout.sleep_level", "3"], "rollout.sleep_level"),
])
def test_rl_settings_that_would_train_on_wrong_numbers_are_refused(argv, message):
    from ds_rlhf.config import validate as check_rl_settings

    with pytest.raises(ConfigError, match=message):
        check_rl_settings(parse_config(argv))


def test_default_rl_settings_pass_the_check():
    from ds_rlhf.config import validate as check_rl_settings

    check_rl_settings(parse_config([]))
    check_rl_settings(parse_config(["--rollout.temperature", "0.7", "--rl.mismatch", "off"]))
    # the rollout engines return the sampled (temperature / top-p / top-k) distribution's log-probs: allowed with TIS
    check_rl_settings(parse_config(["--rollout.temperature", "0.7", "--rollout.top_p", "0.9"]))


def test_a_packaged_recipe_loads_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_file("ds_configs/dapo.yaml") == load_file(packaged_ds_configs() / "dapo.yaml")
    with pytest.raises(ConfigError, match="config file not found: ds_configs/nope.yaml"):
        load_file("ds_configs/nope.yaml")
