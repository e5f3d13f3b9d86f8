"""The names users bring from TRL, OpenRLHF and verl: an alias with one `note:` line where the meaning is ours
exactly, else one `error:` line naming our setting of that meaning, never a wrong "did you mean"."""

from __future__ import annotations

import re

import pytest

from ds_rlhf.config import Config, ConfigError, parse_config
from ds_rlhf.config_keys import RECIPES
from ds_rlhf.config_peers import PEERS, lookup
from ds_rlhf.entrypoints.main import main as ds_rlhf_main


def _get(cfg, dotted):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("command, flag, value, key, expected", [
    ("train-ppo", "beta", "0.04", "rl.kl_coef", 0.04),  # TRL's GRPO beta is the KL coefficient
    ("train-ppo", "num_generations", "8", "rollout.n_samples", 8),
    ("train-ppo", "max_completion_length", "64", "rollout.max_new_tokens", 64),
    ("train-sft", "learning_rate", "2e-5", "optim.lr", 2e-5),
    ("train-ppo", "pretrain", "/models/m", "model.path", "/models/m"),
    ("train-ppo", "micro_train_batch_size", "2", "optim.micro_batch_size", 2),
    ("train-ppo", "init_kl_coef", "0.01", "rl.kl_coef", 0.01),
    ("train-ppo", "actor_rollout_ref.rollout.n", "6", "rollout.n_samples", 6),
    ("train-ppo", "actor_rollout_ref.actor.optim.lr", "3e-6", "optim.lr", 3e-6),
])
def test_a_peer_name_of_the_same_meaning_is_read_as_ours_with_a_note(train_command, capsys, command, flag, value,
                                                                     key, expected):
    cfg = train_command(command, ["--rollout.n_samples", "4", f"--{flag}", value] if command == "train-ppo"
                        else [f"--{flag}", value])
    assert _get(cfg, key) == expected
    assert capsys.readouterr().err.strip().splitlines() == [f"note: --{flag} read as --{key}"]


def test_trl_beta_is_dpo_beta_in_train_dpo_and_the_kl_coefficient_in_train_ppo(train_command):
    dpo = train_command("train-dpo", ["--beta", "0.3"])
    assert dpo.dpo.beta == 0.3
    ppo = train_command("train-ppo", ["--beta", "0.04"])
    assert ppo.rl.kl_coef == 0.04 and ppo.dpo.beta == Config().dpo.beta  # never lands in dpo.beta


def test_verl_nested_keys_in_a_config_file(train_command, tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 6\n  actor:\n    optim:\n      lr: 3.0e-6\n")
    cfg = train_command("train-ppo", ["--config", str(path)])
    assert cfg.rollout.n_samples == 6 and cfg.optim.lr == 3e-6


@pytest.mark.parametrize("command, argv, ours", [
    ("train-ppo", ["--gradient_accumulation_steps", "4"], "--rl.mini_batch_size"),
    ("train-sft", ["--gradient_accumulation_steps", "4"], "--optim.batch_size"),
    ("train-ppo", ["--bf16"], "--model.dtype bf16"),
    ("train-sft", ["--bf16", "true"], "--model.dtype bf16"),
    ("train-ppo", ["--use_peft"], "--model.lora_rank"),
    ("train-ppo", ["--report_to", "wandb"], "--run.wandb true"),
    ("train-ppo", ["--rollout_batch_size", "64"], "--rl.prompts_per_step"),
    ("train-ppo", ["--data.train_batch_size", "64"], "--rl.prompts_per_step"),
    ("train-sft", ["--beta", "0.1"], "--dpo.beta"),
])
def test_a_peer_name_of_another_meaning_is_refused_naming_ours(train_command, command, argv, ours):
    with pytest.raises(SystemExit) as exc:
        train_command(command, argv)
    line = str(exc.value.code)
    assert line.startswith(f"error: {argv[0]} is ") and ours in line and "did you mean" not in line


@pytest.mark.parametrize("command, flag, key", [
    ("train-sft", "num_generations", "rollout.n_samples"),
    ("train-rm", "max_completion_length", "rollout.max_new_tokens"),
    ("train-dpo", "init_kl_coef", "rl.kl_coef"),
])
def test_an_alias_of_another_trainers_setting_is_refused_naming_it(train_command, command, flag, key):
    with pytest.raises(SystemExit) as exc:
        train_command(command, [f"--{flag}", "4"])
    assert str(exc.value.code) == (f"error: --{flag} reads as {key}, a setting of train-ppo; {command} does not "
                                   "read it")


def test_a_hydra_style_argument_names_the_setting_to_give():
    with pytest.raises(ConfigError, match=r"settings are given as --key value; verl's actor_rollout_ref.rollout.n "
                                          r"is --rollout.n_samples 8$"):
        parse_config(["actor_rollout_ref.rollout.n=8"])


@pytest.mark.parametrize("argv, wrong", [
    (["--num_generations", "4"], "async_generation"),
    (["--report_to", "wandb"], "export_hf"),
    (["--pretrain", "m"], "'train'"),
    (["--max_completion_length", "4"], "max_prompt_len'"),
])
def test_no_wrong_suggestion_for_a_peer_name(train_command, capsys, argv, wrong):
    try:
        train_command("train-sft", argv)
        said = capsys.readouterr().err  # an alias here: its note
    except SystemExit as exc:
        said = str(exc.code)
    assert said and wrong not in said and "did you mean" not in said


def test_a_suggestion_is_named_once():
    with pytest.raises(ConfigError) as exc:
        parse_config(["--ds_confg", "x.json"])
    assert str(exc.value).count("'ds_config'") == 1
    with pytest.raises(ConfigError) as exc:
        parse_config(["--rollout.n_sample", "4"])
    assert re.findall(r"'[\w.]+'", str(exc.value)).count("'rollout.n_samples'") == 1


def test_a_command_typed_in_two_words_is_named_as_the_real_command(capsys):
    assert ds_rlhf_main(["train", "rm"]) == 2
    assert "did you mean `ds-rlhf train-rm`?" in capsys.readouterr().err
    assert ds_rlhf_main(["train", "ppo"]) == 2
    assert "did you mean `ds-rlhf train-ppo`?" in capsys.readouterr().err


def test_every_entry_names_real_settings_and_none_is_hidden_by_ours():
    keys = {f"{s}.{f}" for s, sec in Config().to_dict().items() if isinstance(sec, dict) for f in sec}
    for name, entries in PEERS.items():
        for recipe in RECIPES:  # a peer name that is also our key in a recipe would never be read there
            mine = {k for k in keys if k.split(".")[0] in RECIPES[recipe]}
            if lookup(name, recipe) is not None:
                assert name not in mine and name not in {k.split(".")[-1] for k in mine}, (name, recipe)
        for peer in entries:
            assert set(peer.recipes) <= set(RECIPES), name
            if peer.alias:
                assert peer.alias in keys, name
            else:
                named = re.findall(r"--([a-z_]+\.[a-z_]+)", peer.hint)
                assert set(named) <= keys and (named or "--num_gpus" in peer.hint), (name, named)
