"""Numeric ranges, conflicting options and inputs on disk are refused before any model loads, each with one error
naming the key, the value and what is allowed. Each case below would otherwise train nothing, train backwards, be
silently ignored or fail late."""

from __future__ import annotations

import json

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.run.preflight import check_rl_run, check_supervised_run
from tests.recipes.stores import prompt_store, rl_config


@pytest.mark.parametrize("argv, message", [
    (["--rl.ppo_epochs", "0"], "rl.ppo_epochs=0: must be >= 1"),
    (["--rl.mini_batch_size", "-5"], "rl.mini_batch_size=-5: must be >= 0"),
    (["--optim.lr", "-1"], "optim.lr=-1.0: must be > 0"),
    (["--optim.micro_batch_size", "0"], "optim.micro_batch_size=0: must be >= 1"),
    (["--run.keep_last", "-1"], "run.keep_last=-1: must be >= 0"),
    (["--data.max_prompt_len", "-5"], "data.max_prompt_len=-5: must be >= 1"),
    (["--rollout.top_p", "1.5"], "rollout.top_p=1.5: must be <= 1"),
    (["--rollout.gpu_memory_utilization", "0"], "rollout.gpu_memory_utilization=0.0: must be > 0"),
    (["--rl.dual_clip", "0.5"], "dual-clip constant must be > 1"),
    (["--rl.mini_batch_size", "999"], "larger than the 32 rollouts"),
    (["--reward.fn", "gsm8k", "--reward.model_weight", "0.5"], "reward.model_weight=0.5 weighs the reward"),
    (["--zero_stage", "4"], "zero_stage=4: choose one of -1, 0, 1, 2, 3"),
    (["--rollout.max_model_len", "100", "--rollout.max_new_tokens", "128"], "rollout.max_model_len=100"),
    (["--data.rl_packing", "true"], "data.rl_packing=true packs each RL micro-batch up to a token budget"),
    (["--rollout.cudagraph_sizes", "8,x"], "rollout.cudagraph_sizes='8,x': give a comma list"),
    (["--rollout.async_scheduling", "on"], "rollout.async_scheduling='on': choose one of auto, true, false"),
])
def test_out_of_range_and_conflicting_settings_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        parse_config(argv)


@pytest.mark.parametrize("suffix, text, kind", [(".yaml", "rl: [unclosed", "YAML"), (".json", "{\"rl\": ", "JSON")])
def test_malformed_config_file_names_the_file(tmp_path, suffix, text, kind):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config file {path} is not valid {kind}"):
        parse_config(["--config", str(path)])


def _store(tmp_path, tiny_model_path, longest: int):
    return prompt_store(tmp_path, tiny_model_path, lengths=(4, longest, 6))


def test_prompts_longer_than_max_prompt_len_are_refused_with_both_numbers(tmp_path, tiny_model_path):
    store = _store(tmp_path, tiny_model_path, longest=40)
    with pytest.raises(ConfigError, match="prompts of up to 40 tokens but data.max_prompt_len is 32"):
        check_rl_run(rl_config(tmp_path, store, "--data.max_prompt_len", "32"))
    check_rl_run(rl_config(tmp_path, store, "--data.max_prompt_len", "32", "--data.overlong_prompts", "drop"))
    check_rl_run(rl_config(tmp_path, store, "--data.max_prompt_len", "40"))


def test_rl_inputs_on_disk_are_checked_before_set_up(tmp_path, tiny_model_path):
    store = _store(tmp_path, tiny_model_path, longest=8)
    with pytest.raises(ConfigError, match="run.steps=0: an RL run needs at least one step"):
        check_rl_run(rl_config(tmp_path, store, "--run.steps", "0"))
    with pytest.raises(ConfigError, match="data.train='/no/such/store': no such directory"):
        check_rl_run(rl_config(tmp_path, "/no/such/store"))
    with pytest.raises(ConfigError, match="run.resume='/bad/ckpt': no such checkpoint directory"):
        check_rl_run(rl_config(tmp_path, store, "--run.resume", "/bad/ckpt"))
    with pytest.raises(ConfigError, match="reward function file not found: /no/reward.py"):
        check_rl_run(rl_config(tmp_path, store, "--reward.fn", "/no/reward.py:score"))
    with pytest.raises(ConfigError, match="no reward"):
        check_rl_run(rl_config(tmp_path, store, "--reward.fn", ""))
    bad_ds = tmp_path / "ds.json"
    bad_ds.write_text("{\"zero_optimization\": ")
    with pytest.raises(ConfigError, match=f"{bad_ds} is not valid JSON"):
        check_rl_run(rl_config(tmp_path, store, "--ds_config", str(bad_ds)))
    check_rl_run(rl_config(tmp_path, store))


def test_supervised_run_needs_a_store_of_its_kind(tmp_path, tiny_model_path):
    store = _store(tmp_path, tiny_model_path, longest=8)
    cfg = parse_config(["--data.train", str(store)])
    with pytest.raises(ConfigError, match="holds a 'prompts' store; this run needs a 'sft' store"):
        check_supervised_run(cfg, "sft")
    with pytest.raises(ConfigError, match="data.train is empty"):
        check_supervised_run(parse_config([]), "preference")
    assert json.loads((store / "manifest.json").read_text())["kind"] == "prompts"


def test_misspelt_deepspeed_key_is_an_error_and_unknown_ones_are_said(tmp_path, tiny_model_path, capsys):
    store = _store(tmp_path, tiny_model_path, longest=8)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"gradient_clippng": 1.0, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="unknown DeepSpeed key 'gradient_clippng' .did you mean 'gradient_clipping'"):
        check_rl_run(rl_config(tmp_path, store, "--ds_config", str(typo)))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"my_team_notes": "x", "zero_optimization": {"stage": 2}}))
    check_rl_run(rl_config(tmp_path, store, "--ds_config", str(odd)))
    assert "keys DeepSpeed does not read (ignored): my_team_notes" in capsys.readouterr().out


def test_shipped_ds_configs_have_no_keys_deepspeed_ignores():
    """Every ds_configs/*.json is read by DeepSpeed in full: no false "does not read" warning (DeepSpeed 0.19 moved
    ZERO_OPTIMIZATION to deepspeed.runtime.zero.config, and every run warned that zero_optimization was ignored)."""
    from pathlib import Path

    from ds_rlhf.engines.ds_config import check_top_level_keys

    files = sorted((Path(__file__).resolve().parents[2] / "ds_configs").glob("*.json"))
    assert files
    for path in files:
        assert check_top_level_keys(json.loads(path.read_text()), str(path)) == [], path.name


def test_an_explicit_ds_config_value_overriding_the_run_is_recorded():
    """The one precedence rule (explicit ds_config values win) is reported per key; the run prints it at start."""
    from ds_rlhf.engines import ds_config as dsc

    raw = dsc.load_ds_config("zero2")
    raw["optimizer"]["params"]["lr"] = 3e-5
    dsc.resolve_ds_config(raw, micro_batch_size=2, grad_accum=1, world_size=1, precision="fp32", grad_clip=1.0,
                          lr=1e-6, weight_decay=0.0, total_steps=10)
    assert ("optimizer.params.lr", 3e-5, 1e-6) in dsc.OVERRIDES
    dsc.resolve_ds_config(dsc.load_ds_config("zero2"), micro_batch_size=2, grad_accum=1, world_size=1,
                          precision="fp32", grad_clip=1.0, lr=1e-6, weight_decay=0.0, total_steps=10)
    assert dsc.OVERRIDES == []


def test_file_rewards_run_in_a_worker_pool_by_default(tmp_path):
    """A user reward that sleeps cannot hang the run: by default file rewards run in workers with a timeout
    (built-in rules stay in-process)."""
    from ds_rlhf.recipes.rl_build import reward_functions

    path = tmp_path / "r.py"
    path.write_text("def f(prompt, response, ground_truth, metadata):\n    return 1.0\n")
    user = reward_functions(parse_config(["--reward.fn", f"{path}:f", "--reward.timeout", "5"]))
    try:
        assert user.pool is not None
    finally:
        user.close()
    assert reward_functions(parse_config(["--reward.fn", "gsm8k"])).pool is None


def test_a_step_where_every_reward_is_bad_stops_the_run_under_any_policy():
    """on_bad_reward=zero with every reward bad stops the run instead of training on zeros forever."""
    from types import SimpleNamespace

    from ds_rlhf.recipes.reward_stage import RewardStage
    from ds_rlhf.recipes.trajectory import RolloutBatch
    from ds_rlhf.rewards import BadRewardError
    from ds_rlhf.rollout.base import RolloutSample

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    for policy in ("zero", "drop"):
        cfg = parse_config(["--reward.on_bad", policy])
        ctx = SimpleNamespace(cfg=cfg, tokenizer=Tok(), dist=SimpleNamespace(rank=0, device="cpu"))
        stage = RewardStage(ctx, fn=lambda p, r, g, m: float("nan"))
        samples = [RolloutSample(0, i, [1], [2, 3], [-1.0, -1.0], "stop") for i in range(4)]
        with pytest.raises(BadRewardError, match="every reward of this step was bad"):
            stage(RolloutBatch(rows=[{"prompt_text": "", "ground_truth": None}], samples=samples,
                               weights_version=0), step=0)


@pytest.mark.parametrize("argv", [
    ["--rollout.temperature", "0.7", "--rl.mismatch", "tis"],
    ["--rollout.temperature", "0.7", "--rollout.top_p", "0.9", "--rl.mismatch", "mis"],
    ["--rollout.top_k", "20", "--rl.mismatch", "tis"],
])
def test_sampling_settings_are_allowed_with_the_mismatch_correction(argv):
    """The rollout engines return the log-probs of the distribution they sampled from (rollout/base.py), so
    temperature / top-p / top-k are allowed with rl.mismatch tis/mis."""
    parse_config(argv)


def test_rl_packing_with_a_token_budget_is_accepted():
    assert parse_config(["--data.rl_packing", "true", "--data.micro_batch_tokens", "4096"]).data.rl_packing
