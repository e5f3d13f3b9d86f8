"""Held-out RL evaluation: pass@k / mean@k against independent formulas, per-source split, greedy vs sampled
specs, RNG untouched, a real GSM8K store, the best-checkpoint tracker and keep_best."""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch

from ds_rlhf.recipes import eval_metrics, rl_eval
from ds_rlhf.recipes.eval_metrics import pass_at_k
from ds_rlhf.recipes.rl_eval import evaluate, load_eval_rows
from ds_rlhf.rewards.reward_set import RewardSet, RewardSpec
from ds_rlhf.rollout.base import RolloutEngine, RolloutSample
from ds_rlhf.run.checkpoint.best import BestCheckpointTracker, keep_best


# ---- fakes ------------------------------------------------------------------------------------------------------
class CharTokenizer:
    """ids are code points; id 0 is EOS (dropped by decode with skip_special_tokens)."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class FakeEngine(RolloutEngine):
    """Deterministic: `answer(prompt_ids, sample_index)` gives the response text. Consumes the global RNGs on
    purpose, to show that evaluate puts them back."""

    backend = "fake"

    def __init__(self, answer, encode):
        super().__init__()
        self.answer, self.encode, self.specs, self.wakes = answer, encode, [], 0

    def generate(self, prompts, spec):
        self.specs.append(spec)
        torch.rand(3)
        random.random()
        np.random.rand()
        return [RolloutSample(i, j, list(p), self.encode(self.answer(p, j)) + [0], [0.0], "stop")
                for i, p in enumerate(prompts) for j in range(spec.n)]

    def wake(self, tags=None):
        self.wakes += 1
        super().wake(tags)

    def logprobs(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


def reward_from_text(prompt, response, ground_truth, metadata):
    """The fake responses spell their reward: "r=0.5"."""
    random.random()  # a reward function drawing random numbers must not move the run's RNG either
    return float(response.split("=")[1])


def rows_with(rewards_per_prompt: list[list[float]], sources: list[str] | None = None) -> tuple[list[dict], dict]:
    """Rows whose prompt i is `[i + 1]`; returns (rows, {prompt tuple: that prompt's reward list})."""
    rows, table = [], {}
    for i, rewards in enumerate(rewards_per_prompt):
        rows.append({"input_ids": [i + 1], "prompt_text": f"p{i}", "ground_truth": None, "row_id": i,
                     "data_source": sources[i] if sources else "src"})
        table[(i + 1,)] = rewards
    return rows, table


def engine_for(table: dict) -> FakeEngine:
    return FakeEngine(lambda p, j: f"r={table[tuple(p)][j]}", CharTokenizer().encode)


def run_eval(engine, rows, **kw):
    opts = dict(tokenizer=CharTokenizer(), reward_fn=reward_from_text, samples_per_prompt=4, greedy=False,
                max_new_tokens=8, temperature=1.0, top_p=1.0, seed=7, k_values=(1, 2, 4))
    return evaluate(engine, rows, **{**opts, **kw})


# ---- estimators -------------------------------------------------------------------------------------------------
def direct_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # math.comb is 0 when k > n - c


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (4, 0, 1), (4, 0, 4), (4, 4, 1), (4, 4, 4), (4, 1, 1),
                                   (4, 1, 2), (4, 2, 3), (4, 3, 2), (5, 2, 5), (8, 3, 4), (10, 1, 10), (10, 9, 1),
                                   (16, 5, 8), (20, 0, 7), (20, 20, 20), (64, 7, 16)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(direct_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(7, 0, 3) == 0.0 and pass_at_k(7, 7, 3) == 1.0 and pass_at_k(7, 5, 3) == 1.0
    assert pass_at_k(9, 3, 1) == pytest.approx(3 / 9)
    exact = 1 - Fraction(math.comb(900, 100), math.comb(1000, 100))  # binomials far beyond float range
    assert pass_at_k(1000, 100, 100) == pytest.approx(float(exact), rel=1e-9)
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_metrics_over_prompts_pass_and_mean_at_k():
    table_rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    rows, table = rows_with(table_rewards)
    m = run_eval(engine_for(table), rows, k_values=(1, 2, 4, 8))
    cs = [sum(r >= 1.0 for r in rw) for rw in table_rewards]
    for k in (1, 2, 4):
        assert m[f"eval/pass@{k}"] == pytest.approx(np.mean([direct_pass_at_k(4, c, k) for c in cs]))
        assert m[f"eval/mean@{k}"] == pytest.approx(np.mean([sum(rw[:k]) / k for rw in table_rewards]))
    assert m["eval/pass@1"] == pytest.approx(np.mean([c / 4 for c in cs]))
    assert m["eval/mean@1"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert m["eval/mean@2"] == pytest.approx((0.5 + 0 + 1 + 0) / 4)
    assert m["eval/reward_mean"] == pytest.approx(np.mean(table_rewards)) == m["eval/mean@4"]
    assert "eval/pass@8" not in m and "eval/mean@8" not in m  # k > n samples: skipped
    assert m["eval/prompts"] == 4 and m["eval/samples"] == 16 and m["eval/bad"] == 0
    assert m["eval/truncated_frac"] == 0.0 and m["eval/response_len_mean"] == pytest.approx(
        np.mean([len(f"r={r}") + 1 for rw in table_rewards for r in rw]))


def test_threshold_decides_correct():
    rows, table = rows_with([[0.5, 0.5, 0.0, 0.0]])
    assert run_eval(engine_for(table), rows)["eval/pass@1"] == 0.0
    assert run_eval(engine_for(table), rows, threshold=0.5)["eval/pass@1"] == pytest.approx(0.5)


def test_per_source_split():
    rewards = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]]
    rows, table = rows_with([[float(r) for r in rw] for rw in rewards], sources=["a", "a", "b", "b", "b"])
    m = run_eval(engine_for(table), rows)
    assert m["eval/a/pass@1"] == pytest.approx(0.5) and m["eval/a/prompts"] == 2
    assert m["eval/b/pass@1"] == pytest.approx((0.25 + 0.5 + 0.25) / 3) and m["eval/b/prompts"] == 3
    assert m["eval/b/pass@2"] == pytest.approx(np.mean([direct_pass_at_k(4, c, 2) for c in (1, 2, 1)]))
    assert m["eval/b/mean@1"] == pytest.approx(2 / 3)
    assert m["eval/pass@1"] == pytest.approx(np.mean([1, 0, 0.25, 0.5, 0.25]))
    assert "eval/a/samples" not in m  # sample counts are overall only


def test_greedy_and_sampled_specs():
    rows, table = rows_with([[1.0] * 4, [0.0] * 4])
    engine = engine_for(table)
    greedy = run_eval(engine, rows, greedy=True, samples_per_prompt=4, temperature=0.7, top_p=0.9, seed=3)
    spec = engine.specs[-1]
    assert (spec.n, spec.temperature, spec.top_p, spec.seed, spec.stop_token_ids) == (1, 0.0, 1.0, None, (0,))
    assert greedy["eval/pass@1"] == pytest.approx(0.5) and greedy["eval/samples"] == 2
    assert "eval/pass@2" not in greedy and "eval/mean@4" not in greedy
    sampled = run_eval(engine, rows, samples_per_prompt=4, temperature=0.7, top_p=0.9, seed=3, max_new_tokens=5)
    spec = engine.specs[-1]
    assert (spec.n, spec.temperature, spec.top_p, spec.seed, spec.max_new_tokens) == (4, 0.7, 0.9, 3, 5)
    assert sampled["eval/samples"] == 8 and sampled["eval/pass@4"] == pytest.approx(0.5)
    assert engine.wakes == 2
    with pytest.raises(ValueError, match="temperature"):
        run_eval(engine, rows, temperature=0.0)


def test_evaluate_leaves_every_rng_as_it_was():
    rows, table = rows_with([[1.0, 0.0, 1.0, 0.0]] * 3)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(9)
    before = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())
    run_eval(engine_for(table), rows)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_bad_rewards_score_zero_and_are_counted():
    rows, table = rows_with([[1.0, 1.0, 1.0, 1.0]])

    def flaky(prompt, response, ground_truth, metadata):
        raise RuntimeError("boom")

    m = run_eval(engine_for(table), rows, reward_fn=flaky)
    assert m["eval/bad"] == 4 and m["eval/pass@1"] == 0.0
    with pytest.raises(Exception, match="boom"):
        run_eval(engine_for(table), rows, reward_fn=flaky, on_bad_reward="fail")


def test_each_reward_function_and_dict_metric_is_reported():
    """`eval/reward/<function>` and `eval/reward/<function>/<metric>`: means over the samples, beside the summed
    score that pass@k reads (a format check with weight 0 reports format compliance without changing pass@k)."""
    rewards = [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    rows, table = rows_with(rewards)

    def right(prompt, response, ground_truth, metadata):
        return {"score": reward_from_text(prompt, response, ground_truth, metadata), "tail": len(response) % 2}

    def formatted(prompt, response, ground_truth, metadata):
        return float(response.startswith("r=1"))

    reward = RewardSet([RewardSpec(right, name="right"), RewardSpec(formatted, name="fmt", weight=0.0)])
    m = run_eval(engine_for(table), rows, reward_fn=reward)
    responses = [f"r={r}" for rw in rewards for r in rw]
    assert m["eval/reward/right"] == pytest.approx(np.mean(rewards))
    assert m["eval/reward/fmt"] == pytest.approx(np.mean([r.startswith("r=1") for r in responses]))
    assert m["eval/reward/right/tail"] == pytest.approx(np.mean([len(r) % 2 for r in responses]))
    assert m["eval/pass@1"] == pytest.approx(np.mean([sum(rw) / 4 for rw in rewards]))  # weight 0 adds nothing


def test_shards_merge_to_the_whole_set(monkeypatch):
    """Each rank's sums merged equal one evaluation over all rows; pad rows are generated but not counted."""
    rewards = [[float((i * 7 + j) % 3 == 0) for j in range(4)] for i in range(7)]
    rows, table = rows_with(rewards, sources=["a", "b"] * 3 + ["a"])
    whole = run_eval(engine_for(table), rows)
    tallies = []
    monkeypatch.setattr(rl_eval, "gather_tallies", lambda t: tallies.append(t) or [t])
    world = 3
    per_rank = -(-len(rows) // world)
    for rank in range(world):
        shard = rows[rank::world]
        shard += [{**shard[0], rl_eval.PAD_KEY: True}] * (per_rank - len(shard))
        engine = engine_for(table)
        run_eval(engine, shard)
        assert len(engine.specs) == 1
    merged = eval_metrics.tally_metrics(eval_metrics.merge_tallies(tallies))
    assert merged == pytest.approx({k: v for k, v in whole.items() if k != "eval/seconds"})


# ---- a real held-out store: GSM8K ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gsm8k_store(tmp_path_factory, shared_data, tiny_model_path):
    from ds_rlhf.data.prep import prep_gsm8k

    src = shared_data / "gsm8k" / "test.jsonl"
    tmp = tmp_path_factory.mktemp("gsm8k_eval")
    head = tmp / "head.jsonl"  # a temporary file in the test's tmp dir, never in the project
    head.write_text("\n".join(src.read_text(encoding="utf-8").splitlines()[:40]) + "\n", encoding="utf-8")
    return prep_gsm8k(head, tmp / "store", str(tiny_model_path), progress=False).path


def test_gsm8k_store_half_right_gives_pass_at_1_one_half(gsm8k_store, tiny_tokenizer):
    from ds_rlhf.rewards import RewardSet

    rows = load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=32)
    assert len(rows) == 32 and all(r["ground_truth"] and r["data_source"] == "openai/gsm8k" for r in rows)
    truth = {tuple(r["input_ids"]): r["ground_truth"] for r in rows}
    right = {tuple(r["input_ids"]) for r in rows[::2]}

    def answer(prompt_ids, j):
        key = tuple(prompt_ids)
        return f"The answer is #### {truth[key]}" if key in right else "I do not know."

    engine = FakeEngine(answer, lambda text: tiny_tokenizer.encode(text, add_special_tokens=False))
    with RewardSet.from_spec("gsm8k") as rewards:
        m = evaluate(engine, rows, tokenizer=tiny_tokenizer, reward_fn=rewards, samples_per_prompt=2, greedy=False,
                     max_new_tokens=16, temperature=1.0, top_p=1.0, seed=0, k_values=(1, 2))
    assert m["eval/pass@1"] == 0.5 and m["eval/pass@2"] == 0.5 and m["eval/reward_mean"] == 0.5
    assert m["eval/openai/gsm8k/pass@1"] == 0.5 and m["eval/prompts"] == 32
    assert engine.specs[-1].stop_token_ids == (tiny_tokenizer.eos_token_id,)


def test_load_eval_rows_shards_by_rank(gsm8k_store, tiny_tokenizer):
    world = 3
    shards = [load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=10, rank=r, world_size=world)
              for r in range(world)]
    assert [len(s) for s in shards] == [4, 4, 4]  # ceil(10 / 3) each: the short shards are padded
    real = [r["index"] for s in shards for r in s if not r.get(rl_eval.PAD_KEY)]
    assert sorted(real) == list(range(10)) and len(set(real)) == 10
    assert [r.get(rl_eval.PAD_KEY, False) for r in shards[2]] == [False, False, False, True]
    assert all(isinstance(r["input_ids"], list) for r in shards[0])
    many = load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=2, rank=3, world_size=4)
    assert len(many) == 1 and many[0][rl_eval.PAD_KEY]  # more ranks than prompts: this rank only pads
    longest = max(len(r["input_ids"]) for r in load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=10))
    with pytest.raises(ValueError, match="longer than"):
        load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=10, max_prompt_len=longest - 1)
    with pytest.warns(UserWarning, match="leaving out"):
        kept = load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=10, max_prompt_len=longest - 1,
                              overlong="drop")
    assert 0 < len(kept) < 10


def test_load_eval_rows_refuses_a_store_of_another_kind(tmp_path, tiny_tokenizer, tiny_model_path):
    from ds_rlhf.data.prep import prep_gsm8k
    from ds_rlhf.data.store import StoreMismatchError

    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    sft = prep_gsm8k(src, tmp_path / "sft", str(tiny_model_path), kind="sft", progress=False).path
    with pytest.raises(StoreMismatchError):
        load_eval_rows(sft, tiny_tokenizer)


# ---- best checkpoint -------------------------------------------------------------------------------------------
def test_best_tracker_max_min_ties_and_state(tmp_path):
    t = BestCheckpointTracker("eval/pass@1")
    assert t.update(10, {"eval/pass@1": 0.2}) and (t.best_step, t.best_value) == (10, 0.2)
    assert not t.update(20, {"eval/pass@1": 0.2})  # a tie keeps the earlier step
    assert not t.update(30, {"eval/pass@1": float("nan")}) and not t.update(40, {"other": 1.0})
    assert t.update(50, {"eval/pass@1": torch.tensor(0.5)}) and t.best_step == 50
    assert not t.update(60, {"eval/pass@1": 0.4})
    state = t.state_dict()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    again = BestCheckpointTracker("eval/pass@1")
    again.load_state_dict(torch.load(path, weights_only=True))
    assert (again.best_step, again.best_value) == (50, 0.5) and not again.update(70, {"eval/pass@1": 0.5})
    low = BestCheckpointTracker("eval/loss", mode="min")
    assert low.update(1, {"eval/loss": 3.0}) and low.update(2, {"eval/loss": 2.0})
    assert not low.update(3, {"eval/loss": 2.5})
    with pytest.warns(UserWarning, match="starting the best over"):
        low.load_state_dict(state)
    assert low.best_step is None and low.update(4, {"eval/loss": 9.0})
    with pytest.raises(ValueError):
        BestCheckpointTracker("x", mode="up")


def _fake_checkpoint(root, step: int, payload: bytes):
    """A step directory with a COMPLETE manifest in CheckpointManager's format."""
    d = root / "checkpoints" / f"step_{step:08d}"
    (d / "actor").mkdir(parents=True)
    files = {"actor/model.pt": payload, "trainer_state.pt": b"state%d" % step}
    for rel, data in files.items():
        (d / rel).write_bytes(data)
    manifest = {"format": 2, "step": step, "files": {rel: {"size": len(data), "sha256": hashlib.sha256(data)
                                                           .hexdigest()} for rel, data in files.items()}}
    (d / "COMPLETE").write_text(json.dumps(manifest))
    return d


def test_keep_best_links_replaces_and_survives_rotation(tmp_path):
    from ds_rlhf.run.checkpoint.manager import CheckpointManager
    from ds_rlhf.run.run_dir import complete_checkpoints

    first = _fake_checkpoint(tmp_path, 2, b"weights-2")
    (tmp_path / "checkpoints" / ".tmp_best_999").mkdir()  # left by a killed keep_best
    best = keep_best(tmp_path, first, info={"step": 2, "metric": "eval/pass@1", "value": 0.25})
    assert best == tmp_path / "checkpoints" / "best"
    assert (best / "actor" / "model.pt").read_bytes() == b"weights-2"
    assert (best / "actor" / "model.pt").stat().st_ino == (first / "actor" / "model.pt").stat().st_ino  # linked
    assert json.loads((best / "BEST.json").read_text()) == {"source": "step_00000002", "step": 2,
                                                            "metric": "eval/pass@1", "value": 0.25}
    assert not list((tmp_path / "checkpoints").glob(".tmp_best_*"))
    assert CheckpointManager(tmp_path).verify(best) is None  # resumable like any checkpoint
    second = _fake_checkpoint(tmp_path, 4, b"weights-4")
    keep_best(tmp_path, second)
    assert (best / "actor" / "model.pt").read_bytes() == b"weights-4" and not (best / "BEST.json").exists()
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000002", "step_00000004"]
    shutil.rmtree(second)  # keep_last rotation deletes the step directory; the best stays whole
    assert (best / "actor" / "model.pt").read_bytes() == b"weights-4"
    assert CheckpointManager(tmp_path).verify(best) is None
    assert keep_best(tmp_path, best) == best  # the best itself: nothing to do


def test_keep_best_refuses_an_incomplete_checkpoint(tmp_path):
    d = tmp_path / "checkpoints" / "step_00000001"
    d.mkdir(parents=True)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        keep_best(tmp_path, d)
    assert not (tmp_path / "checkpoints" / "best").exists()


def test_real_hf_engine_greedy_is_repeatable_and_rng_free(gsm8k_store, tiny_tokenizer, tiny_model_path):
    """The HF backend on the tiny model: greedy eval twice gives the same metrics; the global RNG never moves."""
    from ds_rlhf.rollout.hf_engine import HFRolloutEngine

    rows = load_eval_rows(gsm8k_store, tiny_tokenizer, max_prompts=3)
    engine = HFRolloutEngine(str(tiny_model_path), device="cpu", dtype="float32")
    before = torch.get_rng_state().clone()
    opts = dict(tokenizer=tiny_tokenizer, reward_fn="gsm8k", samples_per_prompt=2, max_new_tokens=4,
                temperature=1.0, top_p=1.0, seed=11, k_values=(1, 2))
    greedy = [evaluate(engine, rows, greedy=True, **opts) for _ in range(2)]
    sampled = [evaluate(engine, rows, greedy=False, **opts) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), before)
    drop = {"eval/seconds"}
    assert {k: v for k, v in greedy[0].items() if k not in drop} == {k: v for k, v in greedy[1].items()
                                                                    if k not in drop}
    assert {k: v for k, v in sampled[0].items() if k not in drop} == {k: v for k, v in sampled[1].items()
                                                                     if k not in drop}
    assert greedy[0]["eval/samples"] == 3 and sampled[0]["eval/samples"] == 6
    engine.close()
