"""Reward functions and the bad-reward policy: every bad sample is reported, never silently averaged in."""

from __future__ import annotations

import math

import pytest

from ds_rlhf.rewards import (
    BadRewardError,
    extract_final_number,
    gsm8k_reward,
    load_reward_fn,
    score_samples,
)


def test_extract_final_number():
    assert extract_final_number("so 3 + 4 = 7. #### 7") == "7"
    assert extract_final_number("#### 1,234 then #### -5") == "-5"
    assert extract_final_number("#### 2.50") == "2.50"
    assert extract_final_number("no marker 42") is None


def test_gsm8k_exact_match():
    assert gsm8k_reward("", "x #### 42", "42", {}) == 1.0
    assert gsm8k_reward("", "x #### 42.0", "42", {}) == 1.0
    assert gsm8k_reward("", "x #### 41", "42", {}) == 0.0
    assert gsm8k_reward("", "42", "42", {}) == 0.0
    with pytest.raises(ValueError, match="ground truth"):
        gsm8k_reward("", "#### 1", None, {})


def _items(n):
    return [{"prompt": "p", "response": f"r{i}", "ground_truth": None, "metadata": {}, "id": f"s{i}"}
            for i in range(n)]


def _flaky(prompt, response, gt, meta):
    i = int(response[1:])
    if i == 1:
        raise RuntimeError("boom")
    if i == 2:
        return math.nan
    if i == 3:
        return math.inf
    return float(i)


def test_fail_policy_raises_with_sample_ids():
    with pytest.raises(BadRewardError, match=r"3 bad reward.*s1: raised RuntimeError: boom.*s2: returned nan"):
        score_samples(_flaky, _items(5), "fail")


def test_zero_policy_scores_bad_samples_zero_and_reports_them():
    report = score_samples(_flaky, _items(5), "zero")
    assert report.scores == [0.0, 0.0, 0.0, 0.0, 4.0]
    assert report.keep == [True] * 5
    assert [sid for sid, _ in report.bad] == ["s1", "s2", "s3"]


def test_drop_policy_removes_bad_samples():
    report = score_samples(_flaky, _items(5), "drop")
    assert report.keep == [True, False, False, False, True]
    assert len(report.bad) == 3


def test_user_reward_function_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length_reward(prompt, response, ground_truth, metadata):\n    return len(response)\n")
    fn = load_reward_fn(f"{path}:length_reward")
    assert fn("p", "abcd", None, {}) == 4
    with pytest.raises(AttributeError, match="no callable 'missing'"):
        load_reward_fn(f"{path}:missing")
    with pytest.raises(FileNotFoundError):
        load_reward_fn(f"{tmp_path}/nope.py:f")
    with pytest.raises(ValueError, match="unknown reward function"):
        load_reward_fn("bleu")


# --- reliability of the bad-reward policy ---

def _exits(prompt, response, gt, meta):
    i = int(response[1:])
    if i == 0:
        raise SystemExit(3)
    if i == 1:
        raise GeneratorExit("user code")
    return 1.0


def test_system_exit_from_reward_fn_is_a_bad_reward_with_the_sample_id():
    report = score_samples(_exits, _items(3), "zero")
    assert report.scores == [0.0, 0.0, 1.0]
    assert [sid for sid, _ in report.bad] == ["s0", "s1"]
    assert "SystemExit" in report.bad[0][1] and "3" in report.bad[0][1]
    with pytest.raises(BadRewardError, match="s0: raised SystemExit"):
        score_samples(_exits, _items(3), "fail")


def test_keyboard_interrupt_in_process_still_stops_the_trainer():
    def interrupted(prompt, response, gt, meta):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_samples(interrupted, _items(1), "zero")


def test_value_not_finite_in_float32_is_bad():
    def huge(prompt, response, gt, meta):
        return {"r0": 1e300, "r1": -1e39, "r2": 3.0e38}[response]

    report = score_samples(huge, _items(3), "drop")
    assert report.keep == [False, False, True]
    assert [sid for sid, _ in report.bad] == ["s0", "s1"]
    assert "float32" in report.bad[0][1]


def test_all_bad_tells_the_caller_every_sample_failed():
    def nan(prompt, response, gt, meta):
        return math.nan

    assert score_samples(nan, _items(4), "zero").all_bad
    assert score_samples(nan, _items(4), "drop").all_bad
    assert not score_samples(_flaky, _items(5), "zero").all_bad
    assert not score_samples(nan, [], "zero").all_bad
