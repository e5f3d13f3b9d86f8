"""Health warnings: slow steps, low throughput and an idle GPU, each with its likely cause from the phase timers."""

from __future__ import annotations

import pytest

from ds_rlhf.run.health import health_warnings, idle_cause, phase_times, replay


def rec(step, rollout=2.0, train=1.0, sync=0.2, reward=0.1, other=0.1, tokens=1000.0, gpu=90.0):
    wall = rollout + train + sync + reward + other
    return {"step": step, "time/rollout": rollout, "time/train": train, "time/old_logp": 0.0, "time/reference": 0.0,
            "time/critic": 0.0, "time/sync": sync, "time/reward": reward, "time/step": wall - other,
            "time/wall": wall, "throughput/tokens_per_s": tokens * 3.4 / wall, "sys/gpu_util_pct": gpu}


def steady(n=10, **kw):
    return [rec(i + 1, **kw) for i in range(n)]


def test_steady_run_is_quiet():
    assert health_warnings(steady()) == []
    assert replay(steady(30)) == []
    assert health_warnings([]) == []


def test_phase_times_groups_and_data_wait():
    t = phase_times(rec(1, other=0.5))
    assert t["training"] == pytest.approx(1.0) and t["data"] == pytest.approx(0.5)
    assert phase_times({"step": 1}) == {}


@pytest.mark.parametrize("slow, cause", [({"rollout": 4.0}, "rollout"), ({"train": 3.0}, "training"),
                                         ({"sync": 2.0}, "sync"), ({"other": 2.0}, "data"),
                                         ({"reward": 2.5}, "reward")])
def test_slow_step_names_the_phase_that_grew(slow, cause):
    history = steady() + [rec(11, **slow)]
    found = {w.kind: w for w in health_warnings(history)}
    assert found["step_time"].cause == cause and found["step_time"].step == 11
    assert found["step_time"].value > 1.2 * found["step_time"].baseline
    assert "throughput" in found and found["throughput"].cause == cause
    assert cause.split("-")[0] in found["step_time"].message or "waiting on data" in found["step_time"].message


def test_thresholds_and_warm_up():
    assert health_warnings(steady() + [rec(11, rollout=2.5)]) == []  # +15% step time: under the 20% line
    assert health_warnings(steady(3) + [rec(4, rollout=8.0)]) == []  # too little history for a baseline
    low_tokens = steady() + [rec(11, tokens=700.0)]
    assert [w.kind for w in health_warnings(low_tokens)] == ["throughput"]


def test_idle_gpu_cause():
    history = steady() + [rec(11, gpu=40.0, sync=3.0)]
    found = {w.kind: w for w in health_warnings(history)}
    assert found["gpu_util"].cause == "sync" and "40%" in found["gpu_util"].message
    assert idle_cause(rec(1, rollout=0.1, train=5.0, sync=0.1, reward=0.1, other=0.1)) == "training"
    no_gpu = {k: v for k, v in rec(1).items() if k != "sys/gpu_util_pct"}
    assert health_warnings(steady() + [no_gpu]) == []  # CPU runs have no GPU utilisation


def test_without_phase_timers_the_warning_says_so():
    history = [{"step": i, "time/wall": 1.0} for i in range(1, 11)] + [{"step": 11, "time/wall": 2.0}]
    (warning,) = health_warnings(history)
    assert warning.cause == "" and "no phase timers" in warning.message


def rl_rec(step, frac_zero_std=None, std=0.5, mean=0.25):
    out = {**rec(step), "reward/mean": mean, "reward/std": std}
    if frac_zero_std is not None:
        out["reward/frac_zero_std"] = frac_zero_std
    return out


def no_signal(history):
    return [w for w in health_warnings(history) if w.kind == "no_signal"]


def test_three_steps_without_reward_spread_warn_of_no_learning_signal():
    flat = [rl_rec(1, 0.5)] + [rl_rec(s, 1.0, std=0.0, mean=0.0) for s in (2, 3, 4)]
    assert no_signal(flat[:3]) == []  # two steps: not yet
    (warning,) = no_signal(flat)
    assert warning.step == 4 and "3 steps in a row" in warning.message and "every reward 0" in warning.message
    assert "reward function never fires" in warning.message and "rl.reward_fn" in warning.message
    # every group flat but groups differ from each other (reward/std > 0): still no signal
    assert no_signal([rl_rec(s, 1.0, std=0.4) for s in (1, 2, 3)])[0].step == 3
    # one group with a spread in the window: signal
    assert no_signal([rl_rec(1, 1.0), rl_rec(2, 0.75), rl_rec(3, 1.0)]) == []


def test_no_signal_falls_back_to_a_zero_reward_std_and_skips_records_without_rewards():
    assert no_signal([rl_rec(s, std=0.0) for s in (1, 2, 3)])[0].kind == "no_signal"
    assert no_signal([rl_rec(s, std=0.1) for s in (1, 2, 3)]) == []
    assert no_signal(steady(5)) == []  # SFT/RM records: no reward metrics
    assert len([w for w in replay([rl_rec(s, 1.0) for s in range(1, 6)]) if w.kind == "no_signal"]) == 3


def test_frac_zero_std_is_the_share_of_prompt_groups_without_reward_spread():
    from types import SimpleNamespace

    from ds_rlhf.recipes.reward_stage import zero_std_stats

    samples = [SimpleNamespace(prompt_index=p) for p in (0, 0, 1, 1, 2, 2, 3)]
    scores = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]  # groups 0 and 2 flat, 1 spread, 3 has one sample (not counted)
    assert zero_std_stats(samples, scores) == {"reward/frac_zero_std": pytest.approx(2 / 3)}
    assert zero_std_stats(samples[-1:], scores[-1:]) == {}  # no prompt with two samples (e.g. n_samples 1)
    assert zero_std_stats([], []) == {}
