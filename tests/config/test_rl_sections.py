"""An RL run's settings in sections by role (`rl` the algorithm, `reward`, `critic`, `eval`, `env`), and the
`rl.<name>` spelling of each reward / critic / eval / env setting read as its section's key with one `note:` line,
on the command line, in a --config file and in a mapping given in Python."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_rlhf.config import Config, ConfigError, help_text, parse_config
from ds_rlhf.config_rl_names import RL_NAMES, in_sections

ROLE_SECTIONS = ("reward", "critic", "eval", "env")


def _get(cfg, dotted):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def test_every_role_setting_has_its_rl_spelling_and_each_spelling_names_a_key():
    keys = {f"{s}.{f.name}" for s in ROLE_SECTIONS for f in dataclasses.fields(getattr(Config(), s))}
    assert set(RL_NAMES.values()) == keys
    rl_fields = {f.name for f in dataclasses.fields(Config().rl)}
    assert not rl_fields & {spelled.split(".")[1] for spelled in RL_NAMES}  # each one key, in one section


@pytest.mark.parametrize("flag, value, key, expected", [
    ("rl.reward_fn", "gsm8k", "reward.fn", "gsm8k"),
    ("rl.eval_k", "1", "eval.k", "1"),
    ("rl.critic_path", "/models/v", "critic.path", "/models/v"),
    ("rl.environment", "tools.py:Calc", "env.name", "tools.py:Calc"),
    ("rl.episode_max_tokens", "128", "env.max_tokens", 128),
    ("reward_fn", "gsm8k", "reward.fn", "gsm8k"),  # bare: the reward, not eval.reward_fn
    ("rl.on-bad-reward", "zero", "reward.on_bad", "zero"),
])
def test_the_rl_spelling_on_the_command_line_sets_the_key_with_one_note(train_command, capsys, flag, value, key,
                                                                        expected):
    cfg = train_command("train-ppo", ["--rollout.n_samples", "4", f"--{flag}", value])
    assert _get(cfg, key) == expected
    typed = flag.replace("-", "_")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"note: {typed} reads as {key} (its section: [{key.split('.')[0]}]); write {key}"]


def test_the_note_is_printed_once_when_the_file_and_the_command_line_both_use_the_spelling(train_command, capsys,
                                                                                            tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  algo: grpo\n  reward_fn: gsm8k\n  eval_greedy: false\n  eval_samples: 2\n")
    cfg = train_command("train-ppo", ["--config", str(path), "--rl.reward_fn", "format", "--rl.eval_k", "1,2"])
    assert (cfg.rl.algo, cfg.reward.fn, cfg.eval.greedy, cfg.eval.samples, cfg.eval.ks()) == (
        "grpo", "format", False, 2, [1, 2])
    notes = capsys.readouterr().err.strip().splitlines()
    assert sorted(notes) == sorted({f"note: rl.{n} reads as {RL_NAMES['rl.' + n]} (its section: "
                                    f"[{RL_NAMES['rl.' + n].split('.')[0]}]); write {RL_NAMES['rl.' + n]}"
                                    for n in ("reward_fn", "eval_greedy", "eval_samples", "eval_k")})
    assert {"reward.fn", "eval.greedy", "eval.samples", "eval.k"} <= cfg.given


def test_a_mapping_given_in_python_reads_the_spelling_nested_dotted_and_bare(capsys):
    cfg = parse_config([], recipe="train-ppo", settings={"rl": {"reward_model": "/models/rm", "kl_coef": 0.1},
                                                         "rl.max_turns": 3, "best_mode": "min"})
    assert (cfg.reward.model, cfg.rl.kl_coef, cfg.env.max_turns, cfg.eval.best_mode) == ("/models/rm", 0.1, 3, "min")
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # best_mode is also the field's own bare name


def test_a_setting_in_its_own_section_prints_no_note(train_command, capsys):
    cfg = train_command("train-ppo", ["--reward.fn", "gsm8k", "--env.max_turns", "2", "--max_turns", "3"])
    assert (cfg.reward.fn, cfg.env.max_turns) == ("gsm8k", 3)
    assert capsys.readouterr().err == ""


def test_help_lists_the_sections_by_role_with_their_keys():
    text = help_text(recipe="train-ppo")
    for section in ("rl", *ROLE_SECTIONS):
        assert f"\n[{section}]\n" in text
    for key in ("reward.fn", "reward.model", "critic.path", "eval.k", "eval.best_metric", "env.name",
                "env.max_turns"):
        assert f"  --{key} " in text
    assert not [old for old in RL_NAMES if f"\n  --{old} " in text]  # listed as keys only in their sections
    assert "(rl.<name> spellings: --rl.reward_fn, --rl.eval_k" in text


@pytest.mark.parametrize("argv, message", [
    (["--rl.reward_fun", "gsm8k"], "unknown config key 'rl.reward_fun'"),
    (["--reward.reward_fn", "gsm8k"], "unknown config key 'reward.reward_fn'"),
    (["--model", "/models/m"], "--model names the [model] section"),
])
def test_a_key_unknown_in_both_spellings_is_the_unknown_key_error(argv, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(argv, recipe="train-ppo")


def test_the_spelling_in_a_supervised_command_names_the_trainer_that_reads_it(train_command):
    with pytest.raises(SystemExit, match="--rl.reward_fn reads as reward.fn, a setting of train-ppo; train-sft does "
                                         "not read it"):
        train_command("train-sft", ["--rl.reward_fn", "gsm8k"])


def test_a_saved_config_with_the_rl_spellings_reads_in_sections():
    saved = json.loads(json.dumps({"rl": {"algo": "ppo", "critic_path": "/v", "reward_model": "/rm"},
                                   "model": {"path": "m"}}))
    got = in_sections(saved)
    assert got == {"rl": {"algo": "ppo"}, "critic": {"path": "/v"}, "reward": {"model": "/rm"}, "model": {"path": "m"}}
    assert saved["rl"]["critic_path"] == "/v"  # the given mapping is left as it was
    assert in_sections(Config().to_dict()) == Config().to_dict()
