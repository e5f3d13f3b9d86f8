"""One registry per algorithmic choice: config choices, --help and dispatch all come from it."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.algos.registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from ds_rlhf.config import ConfigError, RLConfig, help_text, parse_config
from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages
from ds_rlhf.rollout.base import RolloutSample


@pytest.fixture
def best_of_group():
    """A throw-away estimator, registered the way a user would: one function, one decorator."""

    @ADVANTAGE_ESTIMATORS.register("best_of_group", "+1 for the best sample of each prompt, 0 otherwise",
                                   groups=True)
    def best_of_group(*, scores, mask, group_ids):
        best = torch.zeros_like(scores)
        for g in group_ids.unique():
            rows = (group_ids == g).nonzero().flatten()
            best[rows[scores[rows].argmax()]] = 1.0
        return best[:, None] * mask, None

    yield "best_of_group"
    ADVANTAGE_ESTIMATORS.unregister("best_of_group")


def test_a_registered_estimator_is_a_choice_in_help_and_dispatch(best_of_group):
    cfg = parse_config(["--rl.algo", best_of_group])
    assert cfg.rl.algo == best_of_group
    assert "best_of_group: +1 for the best sample of each prompt" in help_text()
    samples = [RolloutSample(prompt_index=g, sample_index=i, prompt_ids=[1, 2], response_ids=[3, 4],
                             logprobs=[-1.0, -1.0], finish_reason="stop") for i, g in enumerate((0, 0, 1, 1))]
    traj = with_advantages(pad_trajectory(samples, [0.1, 0.9, 0.5, 0.2], pad_id=0), cfg.rl, kl_coef=0.0)
    assert traj.advantages.sum(1).tolist() == [0.0, 2.0, 2.0, 0.0]  # two response tokens each
    # its `groups=True` fact drives the cross-field rule like the built-in group estimators'
    with pytest.raises(ConfigError, match="n_samples >= 2"):
        parse_config(["--rl.algo", best_of_group, "--rollout.n_samples", "1"])


def test_unregistered_estimator_is_gone_again():
    with pytest.raises(ConfigError, match="rl.algo='best_of_group'"):
        parse_config(["--rl.algo", "best_of_group"])


@pytest.mark.parametrize("argv, key, allowed", [
    (["--rl.algo", "nope"], "rl.algo='nope'", "ppo, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline"),
    (["--rl.kl_estimator", "k9"], "rl.kl_estimator='k9'", "k1, k2, k3"),
    (["--rl.loss_agg", "sum"], "rl.loss_agg='sum'", "token-mean"),
    (["--rl.mismatch", "always"], "rl.mismatch='always'", "tis, mis, off"),
    (["--rl.policy_loss", "dpo"], "rl.policy_loss='dpo'", "ppo"),
])
def test_bad_choices_fail_at_parse_time_with_the_allowed_list(argv, key, allowed):
    with pytest.raises(ConfigError) as err:
        parse_config(argv)
    assert key in str(err.value) and allowed in str(err.value)


def test_every_registered_kl_estimator_is_accepted_and_documented():
    text = help_text()
    for name in KL_ESTIMATORS.names():
        assert parse_config(["--rl.kl_estimator", name]).rl.kl_estimator == name
        assert f"      {name}: " in text


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo", "again")(lambda **kw: None)


def test_aliases_resolve_to_their_entry():
    from ds_rlhf.algos.registry import AGGREGATIONS

    assert AGGREGATIONS.canonical("const-norm") == "seq-mean-token-sum-norm"
    assert RLConfig(loss_agg="const-norm").loss_agg in AGGREGATIONS
