"""Reward API: batched and per-sample functions, weighted sets, dict returns, TRL / verl /
OpenRLHF adapters, the math-verify built-in, and the worker pool with its per-call timeout."""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time

import pytest
import torch

from ds_rlhf.rewards import (
    BadRewardError,
    RewardSet,
    RewardSpec,
    detect_style,
    load_reward_fn,
    math_verify_reward,
    score_samples,
)


def _items(responses, truths=None, sources=None):
    truths = truths or [None] * len(responses)
    sources = sources or ["gsm8k"] * len(responses)
    return [{"prompt": f"q{i}:", "response": r, "ground_truth": t, "metadata": {"data_source": s},
             "id": f"s{i}"} for i, (r, t, s) in enumerate(zip(responses, truths, sources))]


def _write(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


# --- calling conventions, in-process ---

def test_batched_function_is_called_once_per_batch():
    calls = []

    def lengths(prompts, responses, ground_truths, metadatas):
        calls.append(len(responses))
        return [float(len(r)) for r in responses]

    assert detect_style(lengths) == "batched"
    report = score_samples(lengths, _items(["a", "bb", "ccc"]), "fail")
    assert report.scores == [1.0, 2.0, 3.0] and calls == [3]


def test_batched_function_returning_the_wrong_length_marks_the_batch_bad():
    def short(prompts, responses, ground_truths, metadatas):
        return [1.0]

    report = score_samples(short, _items(["a", "b"]), "zero")
    assert report.all_bad and "for a batch of 2" in report.bad[0][1]


def test_weighted_set_logs_each_function():
    rewards = RewardSet.from_spec("gsm8k,format", weights="1,0.5")
    assert rewards.names == ["gsm8k", "format"]
    report = score_samples(rewards, _items(["#### 4", "#### 5", "no answer"], ["4", "4", "4"]), "fail")
    assert report.scores == [1.5, 0.5, 0.0]
    assert report.components == {"gsm8k": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}
    assert report.means() == {"reward/gsm8k": pytest.approx(1 / 3), "reward/format": pytest.approx(2 / 3)}


def test_spec_parsing_weights_and_names(tmp_path):
    path = _write(tmp_path, "r.py", "def f(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    rewards = RewardSet.from_spec(f"gsm8k, {path}:f@trl ,gsm8k", weights=[2, 1, 0])
    assert rewards.names == ["gsm8k", "f", "gsm8k_2"] and rewards.weights == [2.0, 1.0, 0.0]
    assert rewards.styles == ["sample", "trl", "sample"]
    with pytest.raises(ValueError, match="2 reward weight"):
        RewardSet.from_spec("gsm8k", weights="1,2")
    with pytest.raises(ValueError, match="finite"):
        RewardSpec("gsm8k", weight=math.inf)
    combined = load_reward_fn(f"gsm8k,{path}:f")  # several functions: a RewardSet score_samples accepts
    assert score_samples(combined, _items(["#### 1"], ["1"]), "fail").scores == [2.0]


def test_dict_return_gives_score_and_extra_metrics():
    def with_extras(prompt, response, gt, meta):
        if response == "nokey":
            return {"accuracy": 1.0}
        return {"score": len(response), "accuracy": 0.5, "pred": "text is not logged"}

    report = score_samples(with_extras, _items(["ab", "abcd", "nokey"]), "drop")
    assert report.scores[:2] == [2.0, 4.0] and report.keep == [True, True, False]
    assert report.extras == {"with_extras/accuracy": [0.5, 0.5, None]}
    assert "without a 'score' key" in report.bad[0][1] and report.bad[0][0] == "s2"
    assert report.means()["reward/with_extras/accuracy"] == 0.5


@pytest.mark.parametrize("value, reason", [(None, "NoneType"), (math.nan, "returned nan"), ([1.0], "list"),
                                           (torch.tensor(2.5), None)])
def test_value_types(value, reason):
    """Per-sample bad values (a bool or a string stops the run: tests/rewards/test_reward_types.py)."""
    report = score_samples(lambda p, r, g, m: value, _items(["x"]), "zero")
    if reason is None:
        assert report.scores == [2.5] and not report.bad
    else:
        assert report.bad[0][0] == "s0" and reason in report.bad[0][1]


def test_one_bad_function_makes_the_sample_bad_and_says_which():
    def boom(prompt, response, gt, meta):
        raise ValueError("no")

    rewards = RewardSet([RewardSpec("format"), RewardSpec(boom, 0.1)])
    report = score_samples(rewards, _items(["#### 1", "x"]), "zero")
    assert report.all_bad and report.bad[0] == ("s0", "boom raised ValueError: no")
    assert report.components["format"] == [1.0, 0.0] and report.components["boom"] == [None, None]


def test_weighted_sum_overflowing_float32_is_bad():
    rewards = RewardSet([RewardSpec(lambda p, r, g, m: 3e38, 1.0, "a"), RewardSpec(lambda p, r, g, m: 3e38, 1.0, "b")])
    with pytest.raises(BadRewardError, match="weighted sum 6e\\+38 is not finite in float32"):
        score_samples(rewards, _items(["x"]), "fail")


# --- other frameworks' reward functions, unchanged ---

def test_trl_style_function(tmp_path):
    path = _write(tmp_path, "trl_reward.py", """
        import re

        def accuracy_reward(prompts, completions, answer, **kwargs):
            assert kwargs["data_source"] == ["gsm8k", "math", "gsm8k"]
            found = [re.findall(r"#### (\\S+)", c) for c in completions]
            return [1.0 if f and f[-1] == a else 0.0 for f, a in zip(found, answer)]
        """)
    fn = load_reward_fn(f"{path}:accuracy_reward")
    assert detect_style(fn) == "trl"
    report = score_samples(fn, _items(["#### 3", "#### 4", "nothing"], ["3", "5", "1"], ["gsm8k", "math", "gsm8k"]),
                           "fail")
    assert report.scores == [1.0, 0.0, 0.0]


def test_verl_style_function(tmp_path):
    path = _write(tmp_path, "verl_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            correct = solution_str.strip().endswith(ground_truth)
            if data_source == "math":
                return {"score": float(correct), "acc": float(correct), "pred": solution_str[-5:]}
            return 1.0 if correct else -1.0
        """)
    fn = load_reward_fn(f"{path}:compute_score")
    assert detect_style(fn) == "verl"
    report = score_samples(fn, _items(["it is 7", "it is 8", "it is 9"], ["7", "7", "9"], ["gsm8k", "gsm8k", "math"]),
                           "fail")
    assert report.scores == [1.0, -1.0, 1.0]
    assert report.extras == {"compute_score/acc": [None, None, 1.0]}


def test_openrlhf_style_function(tmp_path):
    path = _write(tmp_path, "openrlhf_reward.py", """
        import torch

        def reward_func(queries, prompts, labels):
            hits = [float(q.startswith(p) and q.endswith(l)) for q, p, l in zip(queries, prompts, labels)]
            rewards = torch.tensor(hits)
            if labels[0] == "dict":
                lengths = torch.tensor([len(q) for q in queries])
                return {"rewards": rewards, "scores": rewards, "extra_logs": {"length": lengths}}
            return rewards
        """)
    fn = load_reward_fn(f"{path}:reward_func")
    assert detect_style(fn) == "openrlhf"
    assert score_samples(fn, _items(["a 7", "a 8"], ["7", "7"]), "fail").scores == [1.0, 0.0]
    report = score_samples(fn, _items(["dict", "x"], ["dict", "dict"]), "fail")
    assert report.scores == [1.0, 0.0] and report.extras == {"reward_func/length": [7.0, 4.0]}


def test_reward_style_attribute_overrides_detection():
    def per_sample(prompts, responses, ground_truths, metadatas):  # plural names, but per sample
        return float(len(responses))

    per_sample.reward_style = "sample"
    assert score_samples(per_sample, _items(["abc"]), "fail").scores == [3.0]


# --- math-verify built-in ---

def test_math_verify_reward_on_boxed_and_latex_answers():
    assert math_verify_reward("", "so the answer is $\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}", {}) == 1.0
    assert math_verify_reward("", "\\boxed{0.5}", "$\\frac{1}{2}$", {}) == 1.0
    assert math_verify_reward("", "\\boxed{2^{1/2}}", "\\sqrt{2}", {}) == 1.0
    assert math_verify_reward("", "\\boxed{1+x}", "x+1", {}) == 1.0
    assert math_verify_reward("", "#### 1234", "1,234", {}) == 1.0
    assert math_verify_reward("", "\\boxed{4}", "3", {}) == 0.0
    assert math_verify_reward("", "no answer here", "3", {}) == 0.0
    with pytest.raises(ValueError, match="ground truth"):
        math_verify_reward("", "\\boxed{1}", None, {})
    assert load_reward_fn("math_verify") is math_verify_reward
    report = score_samples(RewardSet.from_spec("math_verify,gsm8k"), _items(["\\boxed{3} #### 3"], ["3"]), "fail")
    assert report.components == {"math_verify": [1.0], "gsm8k": [1.0]}


# --- the worker pool ---

_POOL_FNS = """
    import math
    import os
    import sys
    import time

    def misbehave(prompt, response, ground_truth, metadata):
        if response == "hang":
            time.sleep(10**6)
        if response == "exit":
            sys.exit(3)
        if response == "die":
            os._exit(7)
        if response == "interrupt":
            raise KeyboardInterrupt
        if response == "nan":
            return math.nan
        if response == "none":
            return None
        if response == "str":
            return "1.0"
        return {"score": float(len(response)), "pid": os.getpid()}

    def batched(prompts, responses, ground_truths, metadatas):
        if responses[0] == "hang":
            time.sleep(10**6)
        return [float(len(r)) for r in responses]
    """
_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("pool"), "pool_reward.py", _POOL_FNS)


@pytest.fixture(scope="module")
def pooled(pool_file):
    rewards = RewardSet.from_spec(f"{pool_file}:misbehave", workers=2, timeout=_TIMEOUT)
    yield rewards
    rewards.close()


def test_pool_loads_user_file_by_path_in_the_worker_only(pooled):
    report = score_samples(pooled, _items(["ab", "abc"]), "fail")
    assert report.scores == [2.0, 3.0]
    worker_pids = set(report.extras["misbehave/pid"])
    assert worker_pids and os.getpid() not in worker_pids
    assert not [m for m in sys.modules if m.startswith("ds_rlhf_user_reward_pool_reward")]


def test_pool_hang_is_cut_off_and_the_next_call_works(pooled):
    start = time.monotonic()
    report = score_samples(pooled, _items(["hang", "ok"]), "zero")
    elapsed = time.monotonic() - start
    assert elapsed < _TIMEOUT + 3
    assert report.scores == [0.0, 2.0] and report.bad == [("s0", f"timed out after {_TIMEOUT:g}s")]
    start = time.monotonic()
    assert score_samples(pooled, _items(["abcd"]), "fail").scores == [4.0]
    assert time.monotonic() - start < _TIMEOUT + 3


def test_pool_reports_every_kind_of_failure_with_sample_ids(pooled):
    kinds = ["exit", "die", "interrupt", "nan", "none", "fine"]
    report = score_samples(pooled, _items(kinds), "drop")
    reasons = dict(report.bad)
    assert report.keep == [False] * 5 + [True] and report.scores[-1] == 4.0
    assert "SystemExit: 3" in reasons["s0"] and "died (exit code 7)" in reasons["s1"]
    assert "KeyboardInterrupt" in reasons["s2"] and reasons["s3"] == "returned nan"
    assert "NoneType" in reasons["s4"]
    with pytest.raises(BadRewardError, match="returned str .*a string is not a reward"):  # under any policy
        score_samples(pooled, _items(["fine", "str"]), "drop")
    with pytest.raises(BadRewardError, match="s0: raised SystemExit"):
        score_samples(pooled, _items(["exit", "ok"]), "fail")
    assert score_samples(pooled, _items(["ok"] * 6), "fail").scores == [2.0] * 6


def test_pool_batched_function_timeout(pool_file):
    with RewardSet.from_spec(f"{pool_file}:batched", workers=1, timeout=_TIMEOUT) as rewards:
        assert rewards.styles == ["batched"]
        start = time.monotonic()
        report = score_samples(rewards, _items(["hang", "x"]), "zero")
        assert time.monotonic() - start < _TIMEOUT + 3 and report.all_bad
        assert score_samples(rewards, _items(["ab", "abc"]), "fail").scores == [2.0, 3.0]
        assert rewards.pool.replaced == 1


def test_pool_load_error_fails_at_construction(tmp_path):
    path = _write(tmp_path, "broken.py", "raise ImportError('missing dependency')\n")
    with pytest.raises(RuntimeError, match="could not load.*missing dependency"):
        RewardSet.from_spec(f"{path}:f", workers=1, timeout=5)
    path = _write(tmp_path, "ok.py", "x = 1\n")
    with pytest.raises(RuntimeError, match="no callable 'nope'"):
        RewardSet.from_spec(f"{path}:nope", workers=1, timeout=5)
    with pytest.raises(FileNotFoundError):
        RewardSet.from_spec(f"{tmp_path}/missing.py:f", workers=1, timeout=5)
    with pytest.raises(ValueError, match="unknown reward function"):
        RewardSet.from_spec("gsm8k,bleu", workers=1, timeout=5)


def test_pool_rejects_fork_and_unpicklable_functions():
    with pytest.raises(ValueError, match="fork is unsafe"):
        RewardSet.from_spec("gsm8k", workers=1, timeout=1, mp_context="fork")
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        RewardSet([RewardSpec(lambda p, r, g, m: 1.0)], workers=1, timeout=1)


def test_pool_with_forkserver_and_closed_pool():
    rewards = RewardSet.from_spec("gsm8k,math_verify", workers=1, timeout=30, mp_context="forkserver")
    assert score_samples(rewards, _items(["#### 2 so \\boxed{2}"], ["2"]), "fail").scores == [2.0]
    rewards.close()
    with pytest.raises(RuntimeError, match="closed"):
        score_samples(rewards, _items(["x"]), "zero")
