"""Health warnings: slow steps, low throughput and an idle GPU, each with its likely cause from the phase timers."""

from __future__ import annotations

import json
from pathlib import Path

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
    flat = [rec(1)] + [rl_rec(s, 1.0, std=0.0, mean=0.0) for s in (2, 3, 4)]
    assert no_signal(flat[:3]) == []  # two steps: not yet
    (warning,) = no_signal(flat)
    assert warning.step == 4 and "3 steps in a row" in warning.message and "every reward 0" in warning.message
    assert "reward function never fires" in warning.message and "reward.fn" in warning.message
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


def rl_step(step, length, entropy, reward, frac_zero_std=0.3, best=1.0):
    return {**rl_rec(step, frac_zero_std, std=0.3, mean=reward), "response/len_mean": length,
            "actor/entropy": entropy, "reward/max": best}


def kinds(history, kind):
    return [w for w in replay(history) if w.kind == kind]


def collapsing(n=25):
    """Steps 1-10 healthy (length ~227, entropy ~3, reward 0.1 -> 0.3), then the answers shrink to ~18 tokens, the
    entropy to 0.3, the reward sits at the format credit, 0.10-0.13, and 90% of the groups score all alike."""
    out = [rl_step(s, 227 - s, 3.0, 0.1 + 0.02 * s) for s in range(1, 11)]
    for s in range(11, n + 1):
        k = min(1.0, (s - 10) / 8)
        out.append(rl_step(s, 227 - 209 * k, 3.0 - 2.7 * k, 0.10 + 0.03 * (s % 2), frac_zero_std=0.9))
    return out


def test_length_and_entropy_falling_at_a_flat_format_reward_is_named_a_policy_collapse_once():
    (warning,) = kinds(collapsing(), "policy_collapse")
    # step 15: length and entropy under half their peak of the last 10 steps (221 at step 6, 3.0), the reward's
    # last 5 steps flat (0.10-0.13) and low against the best sample reward (1.0)
    assert warning.step == 15
    assert warning.message.startswith("policy collapse suspected at step 15: response length 221->96 tokens and "
                                      "entropy 3->1.3 within the last 10 steps while the reward stays at 0.12")
    assert "rl.scale_rewards batch" in warning.message and "optim.lr" in warning.message
    assert "rl.entropy_coef" in warning.message
    assert [w.kind for w in health_warnings(collapsing()[:15])] == ["policy_collapse"]
    assert health_warnings(collapsing()[:14]) == []


@pytest.mark.parametrize("change", ["reward rises", "entropy holds", "length holds", "reward is high",
                                    "groups differ", "too few steps"])
def test_a_policy_collapse_needs_every_sign(change):
    history = collapsing()
    if change == "reward rises":  # shorter, surer answers that are right: learning, not a collapse
        history = [{**r, "reward/mean": 0.1 + 0.04 * r["step"]} for r in history]
    elif change == "entropy holds":
        history = [{**r, "actor/entropy": 2.9} for r in history]
    elif change == "length holds":
        history = [{**r, "response/len_mean": 200.0} for r in history]
    elif change == "groups differ":  # most groups still tell answers apart: short answers, still learning
        history = [{**r, "reward/frac_zero_std": 0.5} for r in history]
    elif change == "reward is high":  # a flat reward at 0.8 of the best: the task is mostly solved
        history = [{**r, "reward/mean": 0.8 + 0.01 * (r["step"] % 2)} for r in history]
    else:  # steps 7-15: the collapse of step 15 seen in 9 steps, under the 10-step window
        assert [w.step for w in kinds(history[5:15], "policy_collapse")] == [15]
        history = history[6:15]
    assert kinds(history, "policy_collapse") == []


def test_every_groups_rewards_equal_for_k_steps_after_a_spread_is_a_collapse_not_a_reward_bug():
    history = [rl_step(s, 100, 2.0, 0.3) for s in range(1, 6)]
    history += [rl_rec(s, 1.0, std=0.0, mean=0.1) for s in range(6, 12)]
    (warning,) = kinds(history, "flat_rewards")
    assert warning.step == 10 and warning.message.startswith(
        "policy collapse at step 10: in each of the last 5 steps every prompt's samples got the same reward "
        "(every reward 0.1) though step 5's still differed")
    assert kinds(history, "no_signal") == []  # the reward fired before: not the reward function
    assert kinds(history[:9], "flat_rewards") == []  # 4 flat steps
    assert kinds(history, "flat_rewards") == [w for w in replay(history, collapse_steps=5) if w.kind == "flat_rewards"]
    assert [w.step for w in replay(history, collapse_steps=3) if w.kind == "flat_rewards"] == [8]
    assert replay(history, collapse_steps=0) == []
    never = [rl_rec(s, 1.0, std=0.0, mean=0.0) for s in range(1, 8)]  # no spread ever: the reward function
    assert kinds(never, "flat_rewards") == [] and kinds(never, "no_signal")


def test_policy_collapse_is_named_on_the_measured_collapse_only():
    """The learning benchmark's runs on an H100 (docs/perf/raw): length and entropy fall together in every run as
    answers get short, but only the run stuck on the format credit (GRPO's per-group std, seed 1: held-out exact
    match 13% -> 2%, answers of 5-9 tokens, most groups all 0.1) is named, within the steps it sat there."""
    raw = json.loads((Path(__file__).resolve().parents[2] / "docs" / "perf" / "raw" /
                      "learn_arithmetic_scale_rewards_h100.json").read_text())
    named = {}
    for name, run in raw["concurrent_runs"]["runs"].items():
        steps = run["steps"]
        for i in range(1, len(steps) + 1):
            found = [w for w in health_warnings(steps[:i]) if w.kind == "policy_collapse"]
            if found:
                named[name] = found[0].step
                break
    assert set(named) == {"sync_group_s1"}, named
    assert 22 <= named["sync_group_s1"] <= 30


def _raw(name: str) -> dict:
    return json.loads((Path(__file__).resolve().parents[2] / "docs" / "perf" / "raw" / name).read_text())


def _first(steps: list[dict], kind: str) -> int | None:
    return next((w.step for i in range(1, len(steps) + 1) for w in health_warnings(steps[:i]) if w.kind == kind),
                None)


def test_rollouts_trailing_the_trainer_are_named_on_the_measured_drift_only():
    """A float32 trainer with bf16 engines on an H200 (mismatch KL 0.0008 at step 1 to 0.078 at step 13) is named
    once three steps are at 0.02 or more; no healthy run of the learning benchmark (synchronous, and async one
    version stale, up to 0.0073; docs/perf/raw) is."""
    drift = _raw("learn_arithmetic_cap30_precision_h200.json")["runs"]
    fp32 = drift["sync_fp32_trainer_bf16_engines"]["canary_threshold_3_steps"]
    assert _first(fp32, "rollouts_trail") == 9
    found = [w for w in replay(fp32) if w.kind == "rollouts_trail"]
    assert len(found) == 1 and "rollouts trail the trainer at step 9" in found[0].message
    assert "--model.dtype fp32 with bf16/fp16 engines" in found[0].message
    healthy = [drift["sync_bf16"]["steps"]] + [run["steps"] for run in _raw(
        "learn_arithmetic_scale_rewards_h100.json")["concurrent_runs"]["runs"].values()]
    assert all(_first(steps, "rollouts_trail") is None for steps in healthy)
