"""The rollout SamplingSpec of an RL step: its seed is per (run seed, step, rank) and `rollout.seeding` reaches it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.recipes.rl_service import sampling_spec
from ds_rlhf.rollout.base import SamplingSpec, batch_seed


def _ctx(*args, rank=0, world=1):
    return SimpleNamespace(cfg=parse_config(list(args)), dist=SimpleNamespace(rank=rank, world_size=world),
                           tokenizer=SimpleNamespace(eos_token_id=2))


def test_seeding_defaults_to_batch_and_request_is_kept():
    assert sampling_spec(_ctx(), 3).seeding == "batch"
    spec = sampling_spec(_ctx("--rollout.seeding", "request"), 3)
    assert spec.seeding == "request" and spec.request_seed(2) == spec.seed + 2 * spec.n


def test_every_step_and_rank_gets_its_own_seed():
    seeds = {sampling_spec(_ctx(rank=r, world=2), step).seed for step in range(4) for r in range(2)}
    assert len(seeds) == 8


def test_batch_seed_mixes_every_group_and_needs_batch_seeding_everywhere():
    a, b = SamplingSpec(seed=5, seeding="batch"), SamplingSpec(seed=6, seeding="batch")
    assert batch_seed([a]) == 5
    assert batch_seed([a, b]) != batch_seed([b, a]) and batch_seed([a, b]) not in (5, 6)
    assert batch_seed([a, SamplingSpec(seed=6)]) is None  # one group wants per-request seeds
    assert batch_seed([SamplingSpec(seeding="batch")]) is None  # no seed at all: vLLM's own randomness
    with pytest.raises(ValueError, match="seeding"):
        SamplingSpec(seeding="global")


def test_generation_metrics_are_the_engines_time_and_tokens_per_second():
    from ds_rlhf.recipes.rl import generation_metrics
    from ds_rlhf.recipes.trajectory import RolloutBatch
    from ds_rlhf.rollout.base import RolloutSample

    samples = [RolloutSample(0, j, [1, 2], [5] * (3 + j), [-1.0] * (3 + j), "length") for j in range(2)]
    # the engine's call made 28 tokens (three other ranks' too) in 0.5 s: per-engine tokens/s, not this rank's 7
    got = generation_metrics(RolloutBatch(rows=[{}], samples=samples, weights_version=0, generation=(0.5, 28)))
    assert got == {"rollout/generate_seconds": 0.5, "rollout/generate_tokens_per_s": 28 / 0.5}
    # unknown (a batch restored from a checkpoint): nothing is made up
    assert generation_metrics(RolloutBatch(rows=[{}], samples=samples, weights_version=0)) == {}
