"""ThreadedRolloutEngine (rollout/threaded.py): submit returns while the wrapped engine generates on its own thread,
collect hands back its samples (or its error), and nothing else may touch the engine meanwhile."""

from __future__ import annotations

import threading

import pytest
import torch

from ds_rlhf.rollout.base import RolloutEngine, RolloutError, RolloutSample, SamplingSpec
from ds_rlhf.rollout.threaded import ThreadedRolloutEngine


class GatedEngine(RolloutEngine):
    """Generates only once `gate` is set; records which thread generated and every other call made."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.gate, self.started = threading.Event(), threading.Event()
        self.threads, self.calls, self.fail, self.closed = [], [], fail, False

    def generate(self, prompts, spec):
        self.started.set()
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(30)
        if self.fail:
            raise RuntimeError("the engine broke")
        samples = [RolloutSample(i, j, p, [len(p) + j], [-0.5], "length")
                   for i, p in enumerate(prompts) for j in range(spec.n)]
        self._record_generate(samples, 0.25)
        return samples

    def score(self, sequences):
        self.calls.append("score")
        return [[0.0] * (len(s) - 1) for s in sequences]

    def update_weights(self, named_tensors):
        self.calls.append("update")
        list(named_tensors)

    def close(self):
        self.closed = True


def test_submit_returns_before_the_generation_ends_and_collect_waits_for_it():
    inner = GatedEngine()
    engine = ThreadedRolloutEngine(inner)
    ticket = engine.submit([[1, 2], [3]], SamplingSpec(n=2))
    assert inner.started.wait(10) and ticket.samples is None and engine.busy
    inner.gate.set()
    samples = engine.collect(ticket)
    assert [(s.prompt_index, s.sample_index, s.response_ids) for s in samples] == \
        [(0, 0, [2]), (0, 1, [3]), (1, 0, [1]), (1, 1, [2])]
    assert inner.threads == ["ds_rlhf-rollout_0"]  # not the caller's thread
    assert not engine.busy and engine.last_generate() == (0.25, 4)
    assert engine.stats()["generation_thread"] is True and engine.stats()["samples"] == 4
    assert engine.collect(ticket) is samples  # a finished ticket reads back its samples
    engine.close()
    assert inner.closed


@pytest.mark.parametrize("call", [
    lambda e: e.score([[1, 2]]),
    lambda e: e.score_replicas([[1, 2]]),
    lambda e: e.update_weights([("w", torch.zeros(1))]),
    lambda e: e.update_weight_buckets([[("w", torch.zeros(1))]]),
    lambda e: e.sleep(),
    lambda e: e.wake(),
    lambda e: e.reset_cache(),
    lambda e: e.submit([[1]], SamplingSpec()),
])
def test_every_other_call_refuses_while_a_generation_is_in_flight(call):
    inner = GatedEngine()
    engine = ThreadedRolloutEngine(inner)
    ticket = engine.submit([[1]], SamplingSpec())
    with pytest.raises(RolloutError, match="in flight"):
        call(engine)
    assert inner.calls == []  # the wrapped engine never saw it
    inner.gate.set()
    engine.collect(ticket)
    engine.score([[1, 2]])  # idle again: calls go through
    assert inner.calls == ["score"]
    engine.close()


def test_a_failed_generation_raises_at_collect_and_the_engine_stays_usable():
    inner = GatedEngine(fail=True)
    inner.gate.set()
    engine = ThreadedRolloutEngine(inner)
    with pytest.raises(RuntimeError, match="the engine broke"):
        engine.collect(engine.submit([[1]], SamplingSpec()))
    assert not engine.busy
    inner.fail = False
    assert len(engine.generate([[1]], SamplingSpec(n=3))) == 3
    engine.close()


def test_collect_refuses_a_ticket_that_is_not_the_outstanding_one():
    inner = GatedEngine()
    inner.gate.set()
    engine, other = ThreadedRolloutEngine(inner), ThreadedRolloutEngine(GatedEngine())
    foreign = other.submit([[1]], SamplingSpec())
    with pytest.raises(RolloutError, match="not the engine's outstanding"):
        engine.collect(foreign)
    other.inner.gate.set()
    other.collect(foreign)
    engine.close()
    other.close()


def test_close_waits_for_a_running_generation_before_closing_the_engine():
    inner = GatedEngine()
    engine = ThreadedRolloutEngine(inner)
    engine.submit([[1]], SamplingSpec())
    assert inner.started.wait(10)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not inner.closed  # still generating: the engine is not torn down under it
    inner.gate.set()
    closer.join(10)
    assert not closer.is_alive() and inner.closed


def test_an_engine_is_wrapped_once():
    engine = ThreadedRolloutEngine(GatedEngine())
    with pytest.raises(ValueError, match="already generates on its own thread"):
        ThreadedRolloutEngine(engine)
    engine.close()
