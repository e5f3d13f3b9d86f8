"""Partial rollouts (`rollout/partial.py`) on the HF backend and the tiny model, with a trainer whose weights move
every step and a real `WeightSync`: no call generates more than `chunk` tokens per sample; a carried sample continues
from its exact tokens with the newer weights, each chunk's log-probs being those of the weights that generated it;
a group is trained on only when all its samples finished, every drawn prompt exactly once; the checkpoint state
resumes the open groups exactly."""

from __future__ import annotations

import math

import pytest
from rollout_helpers import PROBE, TOL, run_steps
from test_service import DeferringEngine, Trainer

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout.base import SamplingSpec
from ds_rlhf.rollout.partial import PartialRolloutService, max_versions
from ds_rlhf.rollout.weights.canary import SyncCanary
from ds_rlhf.rollout.weights.sync import WeightSync

CHUNK, MAX_NEW, N = 3, 8, 2
STOPS = tuple(range(40, 200))  # a large share of the tiny vocab: responses end at many different lengths
PROMPTS = [[1, 5, 6, 7], [1, 9, 4], [1, 2, 3, 4, 5, 6], [1, 8], [1, 7, 7], [1, 3, 9, 2]]


def _rows():
    k = 0
    while True:
        yield [{"input_ids": [*PROMPTS[(k + i) % len(PROMPTS)], 10 + k + i], "id": k + i} for i in range(2)]
        k += 2


def _spec(step: int) -> SamplingSpec:
    return SamplingSpec(n=N, max_new_tokens=MAX_NEW, seed=1000 + step, stop_token_ids=STOPS)


class Recording(DeferringEngine):
    """The deferring HF engine, recording every call: its `max_new_tokens`, its prompts and the weights version the
    service's engine holds (`version`: set to read it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, list[tuple[int, ...]], int]] = []
        self.version = lambda: -1

    def submit(self, prompts, spec):
        self.calls.append((spec.max_new_tokens, [tuple(p) for p in prompts], self.version()))
        return super().submit(prompts, spec)

    def version_of(self, prompt) -> int:
        """The weights version of the one call that was sent `prompt`."""
        versions = [v for _, prompts, v in self.calls if tuple(prompt) in prompts]
        assert len(set(versions)) == 1, (prompt, versions)
        return versions[0]


def _service(tiny_model_path, *, asynchronous=False, steps=8, trainer=None, drawn=0, chunk=CHUNK):
    trainer = trainer or Trainer(tiny_model_path)
    engine = Recording(str(tiny_model_path), dtype="float32", device="cpu", batch_size=8)
    sync = WeightSync(trainer.model, engine, bucket_bytes=1 << 16, canary=SyncCanary(PROBE))
    rows = _rows()
    for _ in range(drawn):
        next(rows)
    service = PartialRolloutService(engine, sync, prompts=lambda: next(rows), spec=_spec, total_steps=steps,
                                    asynchronous=asynchronous, chunk=chunk)
    engine.version = lambda: service.engine_version
    return trainer, engine, service


@pytest.mark.parametrize("asynchronous", [False, True])
def test_carried_samples_continue_with_newer_weights_and_groups_train_when_complete(tiny_model_path, asynchronous):
    trainer, engine, service = _service(tiny_model_path, asynchronous=asynchronous)
    service.start(0)
    batches = run_steps(trainer, service, 8)
    assert all(limit <= CHUNK for limit, _, _ in engine.calls)
    carried = mixed = 0
    for step, batch in enumerate(batches):
        assert batch.samples and len(batch.samples) == N * len(batch.rows)
        for s in batch.samples:
            assert s.prompt_ids == batch.rows[s.prompt_index]["input_ids"]
            assert (s.finish_reason == "stop") == (s.response_ids[-1] in STOPS)
            assert s.finish_reason == "stop" or len(s.response_ids) == MAX_NEW
            chunks = math.ceil(len(s.response_ids) / CHUNK)
            versions = [engine.version_of(s.prompt_ids + s.response_ids[:k * CHUNK]) for k in range(chunks)]
            assert len(versions) <= max_versions(MAX_NEW, CHUNK)
            assert versions == sorted(versions) and versions[0] >= batch.weights_version
            assert s.weights_version == versions[0]  # a sample counts as its oldest weights
            carried += versions[-1] > versions[0]
            for k, version in enumerate(versions):  # each chunk's log-probs: the weights that generated it
                lo, hi = k * CHUNK, min((k + 1) * CHUNK, len(s.response_ids))
                expected = trainer.logprobs_at(version, s)[lo:hi]
                assert max(abs(a - b) for a, b in zip(expected, s.logprobs[lo:hi])) < TOL, (step, k)
        assert batch.weights_version <= step
        assert batch.weights_version == min(s.weights_version for s in batch.samples)
        mixed += len({s.weights_version for s in batch.samples}) > 1
    assert mixed > 0, "no batch mixed weight versions: the per-sample versions are not exercised"
    assert carried > 0, "no sample was continued with newer weights: the test does not exercise carrying"
    trained = [r["id"] for b in batches for r in b.rows]
    assert len(trained) == len(set(trained))  # every prompt trained on once
    assert sorted(trained + [g.row["id"] for g in service.open]) == list(range(2 * 8))  # or still open


def test_the_open_groups_resume_exactly(tiny_model_path):
    trainer, _, straight = _service(tiny_model_path)
    straight.start(0)
    first = run_steps(trainer, straight, 3)
    state, updates = straight.state_dict(), trainer.generator.get_state()
    assert state["partial_groups"], "nothing open at the checkpoint: the test would not exercise resuming"
    after = run_steps(trainer, straight, 3, start=3)

    # a fresh service with the trainer's weights after step 3 and the loader where the checkpoint left it
    restored_trainer = Trainer(tiny_model_path)
    restored_trainer.model.load_state_dict(trainer.versions[3])
    restored_trainer.versions = trainer.versions[:4]
    restored_trainer.generator.set_state(updates)  # the same later updates
    _, _, resumed = _service(tiny_model_path, trainer=restored_trainer, drawn=3)
    resumed.load_state_dict(state)
    resumed.start(3)
    again = run_steps(restored_trainer, resumed, 3, start=3)
    assert [b.rows for b in again] == [b.rows for b in after]
    assert sum(len(b.rows) for b in first) < 6  # some groups were open at the checkpoint
    for a, b in zip(after, again):
        assert a.weights_version == b.weights_version
        assert [s.response_ids for s in a.samples] == [s.response_ids for s in b.samples]
        assert max(abs(x - y) for sa, sb in zip(a.samples, b.samples) for x, y in zip(sa.logprobs, sb.logprobs)) < TOL


def test_a_call_that_completes_no_group_continues_the_carried_samples(tiny_model_path):
    """With chunk 1 almost no group of two finishes in one call; the batch is never empty."""
    trainer, engine, service = _service(tiny_model_path, chunk=1)
    service.start(0)
    batches = run_steps(trainer, service, 3)
    assert all(b.samples for b in batches)
    assert len(engine.calls) > 3  # extra continuation calls were needed
    assert all(limit == 1 for limit, _, _ in engine.calls)


@pytest.mark.parametrize("extra, match", [
    (["--rollout.partial_tokens", "64"], "not below rollout.max_new_tokens"),
    (["--rollout.partial_tokens", "8", "--rl.dynamic_sampling", "true"], "rl.dynamic_sampling"),
    (["--rollout.partial_tokens", "8", "--env.name", "x.py:Env"], "env.name"),
    (["--rollout.partial_tokens", "8", "--rl.mismatch", "off"], "--rl.mismatch tis"),
])
def test_partial_rollouts_refuse_what_they_cannot_serve(extra, match):
    args = ["--model.path", "m", "--data.train", "t", "--rollout.max_new_tokens", "64", *extra]
    with pytest.raises(ConfigError, match=match):
        parse_config(args)
