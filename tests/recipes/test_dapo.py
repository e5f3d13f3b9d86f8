"""The DAPO toolkit (Yu et al. 2025): dynamic sampling, overlong filtering, the soft overlong penalty, the recipe
file; each switch against a Python reference or a hand-built batch, and the tiny task still learning with all on."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.algos.shaping import group_spread, informative_groups, overlong_penalty
from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout.base import RolloutEngine, RolloutSample
from tests.recipes.stores import prompt_store

ROOT = Path(__file__).resolve().parents[2]


# ---- pure functions against Python references --------------------------------------------------------------
def _penalty_ref(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13, written out."""
    if buffer == 0 or length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - buffer) - length) / buffer
    return -factor


@pytest.mark.parametrize("max_len,buffer,factor", [(20, 4, 1.0), (20480, 4096, 1.0), (16, 16, 0.5), (10, 0, 1.0)])
def test_overlong_penalty_matches_eq13(max_len, buffer, factor):
    lengths = sorted({0, 1, max_len - buffer, max_len - buffer + 1, (2 * max_len - buffer) // 2, max_len - 1,
                      max_len, max_len + 1, max_len + 100} - {-1})
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist()
    for n, value in zip(lengths, got):
        assert value == pytest.approx(_penalty_ref(n, max_len, buffer, factor), abs=1e-6), n


def test_overlong_penalty_boundaries():
    # L_max 20480, L_cache 4096: no penalty up to 16384 tokens, -1/4096 one token later, -0.5 half way, -1 at the end
    p = overlong_penalty(torch.tensor([16384, 16385, 18432, 20480]), 20480, 4096).tolist()
    assert p == pytest.approx([0.0, -1 / 4096, -0.5, -1.0])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 8, 9)


def test_informative_groups_match_a_python_reference():
    rng = random.Random(0)
    for _ in range(50):
        groups = rng.randint(1, 6)
        ids = [rng.randrange(groups) for _ in range(rng.randint(0, 20))]
        scores = [rng.choice([0.0, 0.5, 1.0]) if rng.random() < 0.5 else 1.0 for _ in ids]
        got = informative_groups(torch.tensor(scores), torch.tensor(ids, dtype=torch.long), groups).tolist()
        for g in range(groups):
            mine = [s for s, i in zip(scores, ids) if i == g]
            assert got[g] == (len(mine) >= 2 and max(mine) - min(mine) > 1e-6), (g, mine)
    spread, count = group_spread(torch.tensor([1.0, 3.0, 2.0]), torch.tensor([0, 0, 2]), 3)
    assert spread.tolist() == [2.0, 0.0, 0.0] and count.tolist() == [2, 0, 1]


# ---- config ---------------------------------------------------------------------------------------------------
def test_dapo_recipe_file_parses():
    cfg = parse_config(["--config", str(ROOT / "ds_configs" / "dapo.yaml")])
    rl, r = cfg.rl, cfg.rollout
    assert (rl.clip_low, rl.clip_high, rl.loss_agg, rl.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert rl.dynamic_sampling and rl.overlong_mask and (rl.overlong_buffer, rl.overlong_penalty) == (4096, 1.0)
    assert (r.max_new_tokens, r.n_samples, cfg.optim.lr, rl.algo) == (20480, 16, 1e-6, "grpo")
    # switches default off
    plain = parse_config([])
    assert not plain.rl.dynamic_sampling and not plain.rl.overlong_mask and plain.rl.overlong_buffer == 0
    assert plain.run.export_every == 0


@pytest.mark.parametrize("argv,message", [
    (["--rl.dynamic_sampling", "true", "--rollout.async_generation", "true"], "use one of the two"),
    (["--rl.dynamic_sampling", "true", "--rollout.n_samples", "1", "--rl.algo", "reinforce_pp"],
     "rollout.n_samples >= 2"),
    (["--rl.overlong_buffer", "200", "--rollout.max_new_tokens", "128"], "longer than the generation budget"),
    (["--rl.dynamic_sampling_max_rounds", "0"], "must be >= 1"),
])
def test_dapo_settings_refused_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


# ---- overlong filtering: truncated responses weigh nothing in the loss -----------------------------------------
def _sample(prompt_index, j, n_resp, finish):
    return RolloutSample(prompt_index=prompt_index, sample_index=j, prompt_ids=[1, 2, 3],
                         response_ids=list(range(5, 5 + n_resp)), logprobs=[-0.5] * n_resp, finish_reason=finish)


def test_overlong_mask_zeroes_truncated_rows_but_keeps_their_scores_in_the_baseline():
    from ds_rlhf.algos.advantages import group_advantages
    from ds_rlhf.algos.registry import POLICY_LOSSES
    from ds_rlhf.recipes.policy_update import _share
    from ds_rlhf.recipes.trajectory import pad_trajectory, with_advantages

    samples = [_sample(0, 0, 3, "stop"), _sample(0, 1, 6, "length"), _sample(0, 2, 2, "stop"),
               _sample(1, 0, 6, "length"), _sample(1, 1, 4, "stop")]
    scores = [1.0, 0.0, 0.5, 0.0, 1.0]
    rl = parse_config(["--rl.overlong_mask", "true"]).rl
    plain = pad_trajectory(samples, scores, pad_id=0)
    masked = pad_trajectory(samples, scores, pad_id=0, mask_truncated=True)
    truncated = [s.finish_reason == "length" for s in samples]
    for row, cut in enumerate(truncated):
        assert masked.action_mask[row].sum() == (0 if cut else plain.action_mask[row].sum())
        assert plain.action_mask[row].sum() == len(samples[row].response_ids)
    traj = with_advantages(masked, rl, kl_coef=0.0)
    # the group baseline still sees the truncated samples' scores (as without the mask) ...
    seq = group_advantages(torch.tensor(scores), mode="grpo_batch_std", group_ids=torch.tensor([0, 0, 0, 1, 1]))
    for row, cut in enumerate(truncated):
        if not cut:
            assert traj.advantages[row][traj.action_mask[row].bool()].unique().tolist() == \
                pytest.approx([float(seq[row])])
        else:
            assert traj.advantages[row].abs().sum() == 0
    # ... but their tokens carry no loss weight: zero gradient, not in token-mean's denominator
    logp = traj.rollout_logp.clone().requires_grad_(True)
    loss, _ = POLICY_LOSSES.get("ppo").fn(logp, traj.rollout_logp, traj.advantages, traj.action_mask, clip_low=0.2,
                                          clip_high=0.28, dual_clip=None, agg="token-mean", const_norm=None,
                                          is_weights=None)
    (-loss).backward()
    for row, cut in enumerate(truncated):
        if cut:
            assert logp.grad[row].abs().sum() == 0
        elif float(seq[row]) != 0.0:
            assert logp.grad[row].abs().sum() > 0
    kept_tokens = sum(len(s.response_ids) for s, cut in zip(samples, truncated) if not cut)
    assert float(traj.action_mask.sum()) == kept_tokens
    assert _share(traj.select([1]), "token-mean", float(traj.action_mask.sum()), len(traj)) == 0.0


# ---- the reward stage and dynamic sampling, on a fake engine and a real loader -------------------------------------
class FakeRollout(RolloutEngine):
    """Prompts whose length is a multiple of 3 are 'settled': every sample stops early with the same raw reward (0)
    but different lengths; the others are 'open': samples alternate between truncated and stopped."""

    def __init__(self, settled_only: bool = False):
        super().__init__()
        self.settled_only, self.calls = settled_only, []

    @staticmethod
    def settled(prompt) -> bool:
        return len(prompt) % 3 == 0

    def generate(self, prompts, spec):
        self.calls.append((len(prompts), spec.seed))
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(spec.n):
                cut = not (self.settled_only or self.settled(prompt)) and j % 2 == 0
                n = spec.max_new_tokens if cut else 2 + j
                out.append(RolloutSample(i, j, list(prompt), [7 + j] * n, [-0.1] * n, "length" if cut else "stop"))
        return out

    def logprobs(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


def finished_reward(prompt, response, ground_truth, metadata):
    """1 for a response that stopped, 0 for a truncated one."""
    return float(metadata["finish_reason"] == "stop")


def settled_reward(prompt, response, ground_truth, metadata):
    return 0.0


def _setup(tmp_path, tiny_model_path, tiny_tokenizer, *extra, reward=finished_reward, settled_only=False):
    from ds_rlhf.data.loader import StoreLoader
    from ds_rlhf.recipes.reward_stage import RewardStage

    store = tmp_path / "prompts"
    if not store.exists():
        prompt_store(tmp_path, tiny_model_path, lengths=range(2, 62))
    cfg = parse_config(["--data.train", str(store), "--rl.prompts_per_step", "4", "--rollout.n_samples", "4",
                        "--rollout.max_new_tokens", "8", "--rl.dynamic_sampling", "true", *extra])
    ctx = SimpleNamespace(cfg=cfg, tokenizer=tiny_tokenizer, print=print,
                          dist=SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), is_main=True))
    loader = StoreLoader(store, batch_size=4, seed=0, tokenizer=tiny_tokenizer, expect_kind="prompts")
    parts = SimpleNamespace(environment=None, loader=loader, loader_iter=iter(loader),
                            rollout=FakeRollout(settled_only), reward=RewardStage(ctx, fn=reward), sync=OwedSync())
    return ctx, parts, Steps(ctx, parts)


class Steps:
    """Stage 2b as `RLTrainer.train_step` runs it: `dynamic_batch` over the run's rollout service, then the step's
    sync report."""

    def __init__(self, ctx, parts):
        from ds_rlhf.recipes.rl_service import rollout_service
        from ds_rlhf.telemetry import PhaseTimer

        self.ctx, self.parts, self.timer = ctx, parts, PhaseTimer()
        self.service = rollout_service(parts, ctx, self.timer)

    def run(self, step):
        from ds_rlhf.recipes.dynamic_sampling import dynamic_batch

        scored = dynamic_batch(self.service, self.parts, self.ctx, self.timer, step)
        return scored, self.service.take_report()


class OwedSync:
    """A weight sync made without waiting before the step (`rollout.overlap_sync`): confirmed once, with figures."""

    def __init__(self):
        self.confirms, self.owed = 0, {"canary_max_abs_diff": 0.01}

    @property
    def pending(self):
        return self.owed is not None

    def confirm(self):
        self.confirms += 1
        out, self.owed = self.owed, None
        return out


def _groups(scored):
    out = {}
    for s, raw in zip(scored.samples, scored.raw_scores):
        out.setdefault(s.prompt_index, []).append(raw)
    return out


def test_dynamic_sampling_drops_zero_spread_groups_and_backfills(tmp_path, tiny_model_path, tiny_tokenizer):
    from ds_rlhf.data.loader import StoreLoader

    ctx, parts, steps = _setup(tmp_path, tiny_model_path, tiny_tokenizer, "--rl.dynamic_sampling_max_rounds", "9")
    scored, report = steps.run(0)
    rounds = int(scored.metrics["rollout/dynamic_rounds"])
    # reference: the loader's first `rounds` batches, open prompts kept in order, the first 4 trained on; and no
    # more rounds than needed
    ref = StoreLoader(tmp_path / "prompts", batch_size=4, seed=0, prefetch=0)
    drawn = [list(r["input_ids"]) for k in range(rounds) for r in ref.store.rows(ref.batch_indices(0, k))]
    open_rows = [r for r in drawn if not FakeRollout.settled(r)]
    assert [list(r["input_ids"]) for r in scored.rollout.rows] == open_rows[:4]
    assert len([r for r in drawn[:-4] if not FakeRollout.settled(r)]) < 4 <= len(open_rows)
    assert rounds > 1, "the fixture should need a refill (its first batch holds a settled prompt)"
    assert scored.metrics["rollout/zero_spread_groups"] == len(drawn) - len(open_rows)
    assert scored.metrics["rollout/kept_groups"] == 4
    assert report == {"canary_max_abs_diff": 0.01}  # the sync before the step, confirmed in its first round
    # every trained group has differing raw rewards, and its samples and rows line up
    groups = _groups(scored)
    assert sorted(groups) == [0, 1, 2, 3] and all(max(v) > min(v) for v in groups.values())
    assert all(s.prompt_ids == list(scored.rollout.rows[s.prompt_index]["input_ids"]) for s in scored.samples)
    assert len(scored.samples) == len(scored.scores) == len(scored.texts) == 16
    # the loader moved by every round's draw (its position is saved with checkpoints), one seed per round
    assert parts.loader.state_dict()["step"] == rounds
    assert len({seed for _, seed in parts.rollout.calls}) == rounds
    # reward metrics describe every generated sample (all rounds), the trained ones have their own
    assert scored.metrics["reward/mean"] == pytest.approx(
        (len(drawn) - len(open_rows) + len(open_rows) * 0.5) * 4 / (len(drawn) * 4))
    assert scored.metrics["reward/trained_mean"] == pytest.approx(0.5)


def test_dynamic_sampling_tests_the_raw_reward_not_the_shaped_one(tmp_path, tiny_model_path, tiny_tokenizer):
    """Settled prompts' samples all get raw reward 1 but different lengths, so different overlong penalties: their
    shaped scores differ, yet they carry no signal from the reward functions and are dropped."""
    _, _, steps = _setup(tmp_path, tiny_model_path, tiny_tokenizer, "--rl.overlong_buffer", "6",
                            "--rl.dynamic_sampling_max_rounds", "9")
    scored, _ = steps.run(0)
    assert all(not FakeRollout.settled(r["input_ids"]) for r in scored.rollout.rows)
    penalty = overlong_penalty(torch.tensor([len(s.response_ids) for s in scored.samples]), 8, 6)
    assert scored.scores == pytest.approx((torch.tensor(scored.raw_scores) + penalty).tolist())
    assert scored.metrics["reward/overlong_penalty"] < 0 and "reward/shaped_mean" in scored.metrics


def test_reward_stage_shapes_scores_with_the_soft_penalty(tmp_path, tiny_model_path, tiny_tokenizer):
    from ds_rlhf.recipes.trajectory import RolloutBatch

    ctx, parts, _ = _setup(tmp_path, tiny_model_path, tiny_tokenizer, "--rl.overlong_buffer", "4",
                           "--rl.overlong_penalty", "0.5", "--rl.dynamic_sampling", "false")
    samples = [_sample(0, j, n, "stop" if n < 8 else "length") for j, n in enumerate([2, 4, 5, 6, 8])]
    scored = parts.reward(RolloutBatch(rows=[{"input_ids": [1, 2, 3]}], samples=samples, weights_version=0), step=0)
    raw = [finished_reward("", "", None, {"finish_reason": s.finish_reason}) for s in samples]
    assert scored.raw_scores == raw
    assert scored.scores == pytest.approx([r + _penalty_ref(len(s.response_ids), 8, 4, 0.5)
                                           for r, s in zip(raw, samples)])
    assert scored.metrics["reward/mean"] == pytest.approx(sum(raw) / len(raw))  # metrics: the raw reward


def test_dynamic_sampling_stops_at_the_round_bound(tmp_path, tiny_model_path, tiny_tokenizer):
    """No prompt ever has differing rewards: 3 rounds, then the first round's prompts (zero advantages)."""
    _, parts, steps = _setup(tmp_path, tiny_model_path, tiny_tokenizer, "--rl.dynamic_sampling_max_rounds", "3",
                                reward=settled_reward, settled_only=True)
    scored, report = steps.run(0)
    # the sync before the step is confirmed once, after the first round's generation, and reported with the step
    assert parts.sync.confirms == 1 and report == {"canary_max_abs_diff": 0.01}
    assert scored.metrics["rollout/dynamic_rounds"] == 3 and scored.metrics["rollout/kept_groups"] == 0
    assert scored.metrics["rollout/zero_spread_groups"] == 12
    assert len(scored.rollout.rows) == 4 and len(scored.samples) == 16 and len(parts.rollout.calls) == 3


def test_every_rank_runs_the_rounds_the_neediest_rank_needs(tmp_path, tiny_model_path, tiny_tokenizer, monkeypatch):
    """Another rank is still short (agree_max says 1): this rank keeps generating until the bound, with all ranks,
    and still trains on exactly prompts_per_step prompts."""
    import ds_rlhf.recipes.dynamic_sampling as schedule_module

    asked = []
    monkeypatch.setattr(schedule_module, "agree_max", lambda value, device: asked.append(value) or 1)
    _, parts, steps = _setup(tmp_path, tiny_model_path, tiny_tokenizer, "--rl.dynamic_sampling_max_rounds", "5")
    scored, _ = steps.run(0)
    assert scored.metrics["rollout/dynamic_rounds"] == 5 and len(asked) == 4  # asked after every round but the last
    assert asked[-1] == 0  # this rank had enough by then
    assert len(scored.rollout.rows) == 4 and parts.loader.state_dict()["step"] == 5


def test_dynamic_sampling_resumes_exactly(tmp_path, tiny_model_path, tiny_tokenizer):
    """The loader position after a step's extra draws, restored into a fresh loader, gives the next steps the same
    prompts as an uninterrupted run."""
    def rows(scored):
        return [list(r["input_ids"]) for r in scored.rollout.rows]

    _, _, straight = _setup(tmp_path, tiny_model_path, tiny_tokenizer)
    expected = [rows(straight.run(step)[0]) for step in range(3)]
    _, parts, first = _setup(tmp_path, tiny_model_path, tiny_tokenizer)
    assert rows(first.run(0)[0]) == expected[0]
    state = parts.loader.state_dict()
    _, fresh, resumed = _setup(tmp_path, tiny_model_path, tiny_tokenizer)
    fresh.loader.load_state_dict(state)
    assert [rows(resumed.run(step)[0]) for step in (1, 2)] == expected[1:]


# ---- the tiny task still learns with the whole recipe on ---------------------------------------------------------
def _mean(xs):
    return sum(xs) / len(xs)


DAPO_SWITCHES = ["--rl.dynamic_sampling", "true", "--rl.dynamic_sampling_max_rounds", "3", "--rl.overlong_mask",
                 "true", "--rl.overlong_buffer", "8", "--rl.overlong_penalty", "1.0", "--rl.clip_low", "0.2",
                 "--rl.clip_high", "0.28", "--rl.loss_agg", "token-mean", "--rl.kl_coef", "0"]


@pytest.mark.extended
@pytest.mark.slow
def test_dapo_recipe_still_learns(sft_run, addition_stores, vllm_colocated, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer
    from tests.recipes.test_rl_e2e import rl_args

    history = RLTrainer(parse_config(rl_args(tmp_path, sft_run[0] / "export", addition_stores, "grpo", 12,
                                             DAPO_SWITCHES)), rollout=vllm_colocated).train()
    rewards = [h["reward/mean"] for h in history]
    print("dapo rewards", [round(r, 3) for r in rewards],
          "rounds", [h["rollout/dynamic_rounds"] for h in history],
          "zero-spread", [h["rollout/zero_spread_groups"] for h in history],
          "masked", [round(h["response/loss_masked_frac"], 3) for h in history])
    assert _mean(rewards[-4:]) > _mean(rewards[:4]) + 0.1, rewards
    for h in history:
        assert 1 <= h["rollout/dynamic_rounds"] <= 3 and h["rollout/kept_groups"] <= 16
        assert "reward/overlong_penalty" in h and "response/loss_masked_frac" in h
        assert all(not (isinstance(v, float) and math.isnan(v)) for v in h.values())
        # the trained batch: the prompts with differing rewards (all of the first round's when there were none)
        assert h["rollout/samples"] == 8 * (h["rollout/kept_groups"] or 16)


@pytest.mark.extended
@pytest.mark.slow
def test_dapo_resume_from_a_checkpoint_is_exact(sft_run, addition_stores, vllm_colocated, tmp_path):
    """Steps 3-4 resumed from step 2's checkpoint equal the uninterrupted run's: the loader position after the
    extra rounds' draws is in the checkpoint."""
    from ds_rlhf.recipes.rl import RLTrainer
    from tests.recipes.test_rl_e2e import EXACT_KEYS, rl_args

    model = sft_run[0] / "export"
    common = [*DAPO_SWITCHES, "--run.save_every", "2", "--optim.lr", "3e-4"]
    straight = RLTrainer(parse_config(rl_args(tmp_path / "a", model, addition_stores, "grpo", 4, common)),
                         rollout=vllm_colocated).train()
    resume = ["--run.resume", str(tmp_path / "a" / "checkpoints" / "step_00000002")]
    resumed = RLTrainer(parse_config(rl_args(tmp_path / "b", model, addition_stores, "grpo", 4, [*common, *resume])),
                        rollout=vllm_colocated).train()
    assert len(resumed) == 2
    assert max(h["rollout/dynamic_rounds"] for h in straight[:2]) > 1  # extra draws before the checkpoint
    for a, b in zip(straight[2:], resumed):
        for key in (*EXACT_KEYS, "rollout/dynamic_rounds", "rollout/zero_spread_groups", "rollout/kept_groups"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
