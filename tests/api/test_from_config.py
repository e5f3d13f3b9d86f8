"""The Python API's settings and inputs (`ds_rlhf/api.py`), without a model: the forms `cfg` takes, the reward
callables (registered, added to `reward.fn`, loaded and called by the reward machinery), the environment object,
and its one-line refusals. The README's notebook cell runs end to end in tests/api/test_notebook_cell.py."""

from __future__ import annotations

import json

import pytest

import ds_rlhf
from ds_rlhf import api
from ds_rlhf.agent.adapters import TRLEnvironment, load_environment
from ds_rlhf.agent.examples.calculator import CalculatorEnv
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rewards.loading import load_reward_fn
from ds_rlhf.rewards.reward_set import RewardSet
from ds_rlhf.run.preflight import check_reward

SETTINGS = {"model.path": "tiny", "data.train": "stores/prompts", "rl.algo": "rloo", "rl.kl_coef": 0.02}
NESTED = {"model": {"path": "tiny"}, "data": {"train": "stores/prompts"}, "rl": {"algo": "rloo", "kl_coef": 0.02}}


def trl_len(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


@pytest.mark.parametrize("form", ["dotted", "nested", "yaml", "json", "Config"])
def test_every_form_of_cfg_reads_the_same_settings(form, tmp_path):
    if form in ("yaml", "json"):
        path = tmp_path / f"run.{form}"
        path.write_text(json.dumps(NESTED))  # JSON is YAML too
        cfg = str(path)
    else:
        cfg = {"dotted": SETTINGS, "nested": NESTED}.get(form) or parse_config(
            [f"--{k}={v}" for k, v in SETTINGS.items()], recipe="train-ppo")
    before = cfg.to_dict() if form == "Config" else None
    trainer = api.RLTrainer.from_config(cfg, reward_fns=[trl_len])
    got = trainer.cfg
    assert (got.model.path, got.data.train, got.rl.algo, got.rl.kl_coef) == ("tiny", "stores/prompts", "rloo", 0.02)
    if form == "Config":
        assert cfg.to_dict() == before and cfg.reward.fn == ""  # the caller's Config is copied, not changed
    else:
        assert got.run.output_dir == "runs/ppo"  # the command's defaults (train-ppo) apply under the given settings
    assert got.reward.fn.startswith("python:trl_len") and load_reward_fn(got.reward.fn) is trl_len


def test_a_recipe_reads_only_its_sections_and_the_other_trainers_exist():
    with pytest.raises(ConfigError) as exc:
        api.SFTTrainer.from_config({"model.path": "tiny", "rl.algo": "grpo"})
    assert "train-sft does not read it" in one_line(exc)
    assert api.DPOTrainer.from_config({"dpo.beta": 0.3}).cfg.dpo.beta == 0.3
    assert api.RMTrainer.from_config({"data.train": "prefs"}).cfg.run.output_dir == "runs/rm"
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config({"rl.algoo": "grpo"})
    assert "unknown config key 'rl.algoo'" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config(42)
    assert "cfg is a int" in one_line(exc)
    assert ds_rlhf.RLTrainer is api.RLTrainer and ds_rlhf.TrainResult is api.TrainResult  # the lazy re-export


def test_lambdas_are_registered_weighed_and_called_by_the_reward_set():
    calls = []
    trainer = api.RLTrainer.from_config(
        {**SETTINGS, "reward.fn": "gsm8k", "reward.weights": "2"},
        reward_fns=[lambda prompt, response, truth, meta: calls.append(response) or 1.0,
                    (lambda prompts, completions, **kw: [0.5 for _ in completions], "trl")])
    parts = trainer.cfg.reward.fn.split(",")
    assert parts[0] == "gsm8k" and parts[1].startswith("python:lambda") and parts[2].endswith("@trl")
    assert trainer.cfg.reward.weights == "2.0,1.0,1.0"  # the config's weight for its own function, 1 for each callable
    check_reward(trainer.cfg)  # the preflight accepts the in-process specs (no file to find)
    with RewardSet.from_spec(trainer.cfg.reward.fn, trainer.cfg.reward.weights, workers=0, announce=None) as rewards:
        assert rewards.styles == ["sample", "sample", "trl"]
        outcomes = rewards.evaluate([{"prompt": "1+1?", "response": "#### 2", "ground_truth": "2", "metadata": {}}])
    assert [o[0][0] for o in outcomes] == [1.0, 1.0, 0.5] and calls == ["#### 2"]
    with RewardSet.from_spec(",".join(parts[1:]), workers=2, announce=None) as rewards:
        assert rewards.pool is None  # beside a file's functions in workers, the callables stay in this process
    named = api.RLTrainer.from_config(SETTINGS, reward_fns={"exact": trl_len, "exact ": trl_len},
                                      reward_weights=[1, 0.25]).cfg.reward
    assert named.fn.split(",")[0].startswith("python:exact") and named.weights == "1.0,0.25"


def test_a_non_callable_reward_and_reward_workers_are_refused_in_one_line():
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config(SETTINGS, reward_fns=[trl_len, "gsm8k"])
    assert one_line(exc).startswith("reward_fns[1] is a str ('gsm8k'), not a callable")
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config({**SETTINGS, "reward.workers": 2}, reward_fns=[lambda p, c, **k: [0.0]])
    assert one_line(exc).startswith("reward.workers=2 runs reward functions in worker processes")
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config(SETTINGS, reward_fns=[trl_len], reward_weights=[1, 2])
    assert "2 reward weight(s) for 1 reward function(s)" in one_line(exc)
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config(SETTINGS, reward_fns=[(trl_len, "tlr")])
    assert "calling convention 'tlr' is not one of" in one_line(exc)


class Counter:
    """A TRL environment_factory class: public methods are the tools."""

    def reset(self, **kwargs):
        self.n = 0

    def add(self, k: int) -> str:
        """Add to the counter.

        Args:
            k: how much to add
        """
        self.n += k
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n)


def test_an_environment_is_given_as_the_object():
    cfg = api.RLTrainer.from_config(SETTINGS, environment=CalculatorEnv).cfg
    assert cfg.env.name.startswith("python:CalculatorEnv")
    assert load_environment(cfg.env.name) is CalculatorEnv
    cfg = api.RLTrainer.from_config(SETTINGS, environment=Counter).cfg
    assert isinstance(load_environment(cfg.env.name)(), TRLEnvironment)
    check_reward(cfg)  # the environment's reward is the run's reward
    with pytest.raises(ConfigError) as exc:
        api.RLTrainer.from_config(SETTINGS, environment=CalculatorEnv())
    assert "give an environment class or a list of tool functions" in one_line(exc)
    with pytest.raises(ConfigError) as exc:  # the config's rules for episodes hold for an object too
        api.RLTrainer.from_config({**SETTINGS, "rl.dynamic_sampling": True, "rollout.n_samples": 2},
                                  environment=Counter)
    assert "rl.dynamic_sampling is not supported with episodes" in one_line(exc)


def test_train_raises_the_users_error_and_a_signal_stop_as_exceptions(tmp_path):
    trainer = api.RLTrainer.from_config({**SETTINGS, "data.train": str(tmp_path / "missing"),
                                         "run.output_dir": str(tmp_path / "run")}, reward_fns=[trl_len])
    with pytest.raises(ConfigError) as exc:  # the preflight's line, not SystemExit
        trainer.train()
    assert str(tmp_path / "missing") in one_line(exc)

    class Stopped(api.RLTrainer):
        RUN = staticmethod(lambda cfg: (_ for _ in ()).throw(SystemExit(130)))  # what a SIGINT stop raises

    with pytest.raises(KeyboardInterrupt, match="stopped by signal 2; the last checkpoint is under"):
        Stopped(trainer.cfg).train()
