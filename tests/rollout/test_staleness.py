"""Bounded staleness (`rollout.max_staleness` k, async generation) on the HF backend and the tiny model, with a
trainer whose weights move every step and a real `WeightSync`: the batch step s trains on was generated with the
weights after at least s - k updates, and k updates behind at times (one sync every k steps); every sample carries
the weights version that generated it (its log-probs are those weights'); a checkpoint taken at any step (the
batches the older weights still owe generated and saved with it) resumes onto exactly the batches of the
uninterrupted run; an evaluation's sync to the step's weights changes no later batch."""

from __future__ import annotations

import pytest
from rollout_helpers import PROBE, TOL, run_steps
from test_service import DeferringEngine, Trainer, _rows, _spec

from ds_rlhf.rollout.service import RolloutService
from ds_rlhf.rollout.weights.canary import SyncCanary
from ds_rlhf.rollout.weights.sync import WeightSync


class Draws:
    """The prompt rows of `test_service._rows`, counting draws (a restored loader skips that many)."""

    def __init__(self, skip: int = 0):
        self.rows, self.count = _rows(), 0
        for _ in range(skip):
            self()

    def __call__(self):
        self.count += 1
        return next(self.rows)


def _service(tiny_model_path, k: int, steps: int, trainer=None, skip: int = 0):
    trainer = trainer or Trainer(tiny_model_path)
    engine = DeferringEngine(str(tiny_model_path), dtype="float32", device="cpu", batch_size=4)
    sync = WeightSync(trainer.model, engine, bucket_bytes=1 << 16, canary=SyncCanary(PROBE))
    draws = Draws(skip)
    service = RolloutService(engine, sync, prompts=draws, spec=_spec, total_steps=steps, asynchronous=True,
                             max_staleness=k)
    return trainer, service, draws


def _key(batch):
    return [(tuple(s.response_ids), s.weights_version) for s in batch.samples]


@pytest.mark.parametrize("k", [2, 4])
def test_batches_lag_at_most_k_updates_and_exactly_k_at_times(tiny_model_path, k):
    steps = 2 * k + 2
    trainer, service, _ = _service(tiny_model_path, k, steps)
    service.start(0)
    batches = run_steps(trainer, service, steps)
    lags = [step - b.weights_version for step, b in enumerate(batches)]
    assert all(0 <= lag <= k for lag in lags), lags
    # one sync every k steps: the weights of a sync serve k batches, 1, 2, ..., k updates old
    assert lags == [0, *range(1, k + 1), *range(1, k + 1), 1], lags
    for b in batches:
        for s in b.samples:  # every sample says which weights generated it, and they did
            assert s.weights_version == b.weights_version
            assert max(abs(x - y) for x, y in zip(trainer.logprobs_at(s.weights_version, s), s.logprobs)) < TOL
    # the check can tell versions apart: the batch k behind is not the newest weights'
    stale = batches[k].samples[0]
    assert max(abs(x - y) for x, y in zip(trainer.logprobs_at(k, stale), stale.logprobs)) > 1e-3


@pytest.mark.parametrize(("k", "save_at"), [(2, 3), (4, 2), (4, 3)])
def test_a_checkpoint_at_any_step_resumes_onto_the_uninterrupted_batches(tiny_model_path, k, save_at):
    """The checkpoint after `save_at` updates (the engine still holds older weights the schedule uses for later
    batches) holds those later batches too; the resumed engine holds the trainer's newer weights, yet every batch
    after it is the uninterrupted run's: same responses, same weights versions."""
    steps = 8
    trainer, service, _ = _service(tiny_model_path, k, steps)
    service.start(0)
    straight = run_steps(trainer, service, save_at)
    service.quiesce()  # the uninterrupted run saves there too
    straight += run_steps(trainer, service, steps - save_at, start=save_at)

    trainer2, first, draws = _service(tiny_model_path, k, steps)
    first.start(0)
    before = run_steps(trainer2, first, save_at)
    first.quiesce()
    state = first.state_dict()
    # the batch in flight, then those the older weights still owe: up to step schedule_version + k
    assert len(state["ahead"]) == state["schedule_version"] + k - save_at > 0
    _, resumed, _ = _service(tiny_model_path, k, steps, trainer=trainer2, skip=draws.count)  # loader restored
    resumed.load_state_dict(state)
    resumed.start(save_at)  # the resumed run's first sync: the trainer's weights after save_at updates
    after = run_steps(trainer2, resumed, steps - save_at, start=save_at)
    assert [_key(b) for b in before + after] == [_key(b) for b in straight]
    assert max(save_at - v for v in (s.weights_version for s in after[0].samples)) > 0  # older than the engine's


def test_an_evaluation_sync_changes_no_later_batch(tiny_model_path):
    """k = 4, an evaluation after 2 updates syncs the engine to them (the schedule would sync only after 4): the
    batches of steps 3 and 4, generated with the older weights before the sync, and every later one are those of
    a run without the evaluation."""
    k, steps = 4, 8
    trainer, service, _ = _service(tiny_model_path, k, steps)
    service.start(0)
    plain = run_steps(trainer, service, steps)
    trainer2, evaluated, _ = _service(tiny_model_path, k, steps)
    evaluated.start(0)
    batches = run_steps(trainer2, evaluated, 2)
    evaluated.quiesce(2)
    assert evaluated.engine_version == 2 and evaluated.schedule_version == 0
    batches += run_steps(trainer2, evaluated, steps - 2, start=2)
    assert [_key(b) for b in batches] == [_key(b) for b in plain]
