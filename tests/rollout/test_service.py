"""RolloutService on the HF backend and the tiny model, with a trainer model whose weights move between steps and a
real `WeightSync` (with its canary): a batch is returned only once the sync of the weights that generated it is
confirmed, and its log-probs are those weights'; in async mode the next batch is in flight after `batch`; a sync
made without waiting is confirmed exactly once; `quiesce` leaves nothing owed by the engine; `state_dict` is pure
and round-trips. The deferring engine is the HF engine with a server's timing (replies read later), no vLLM."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from rollout_helpers import PROBE, TOL

from ds_rlhf.rollout.base import Pending, RolloutError, RolloutTicket, SamplingSpec, WeightTransport
from ds_rlhf.rollout.hf_engine import HFRolloutEngine
from ds_rlhf.rollout.service import RolloutService
from ds_rlhf.rollout.weights.canary import SyncCanary, trainer_logprobs
from ds_rlhf.rollout.weights.sync import WeightSync

PROMPTS = [[1, 5, 6, 7], [1, 9, 4], [1, 2, 3, 4, 5, 6], [1, 8]]


class AcknowledgedLater(WeightTransport):
    """The HF engine's loads, made when handed over and acknowledged when the reply is read (counted in the
    engine's `acks`)."""

    def __init__(self, loads: WeightTransport, engine) -> None:
        super().__init__()
        self.loads, self.engine, self.dtype = loads, engine, loads.dtype

    def send(self, buckets, plan=None, *, wait=True):
        self.loads.send(buckets, plan)
        return Pending(self._acknowledge)

    def _acknowledge(self):
        self.engine.acks += 1


class DeferringEngine(HFRolloutEngine):
    """The HF engine with a server's timing: `submit` returns at once and the samples are made at `collect`; a
    weight update is loaded when handed over but acknowledged when its reply is read, and the canary's scores are
    computed when read. `outstanding`: tickets submitted and not collected; `acks`: acknowledgements read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outstanding, self.acks = 0, 0
        self.weights = AcknowledgedLater(self.weights, self)

    @property
    def defers_replies(self) -> bool:
        return True

    def submit(self, prompts, spec):
        if self.outstanding:
            raise RolloutError("a generation is already in flight: collect it first")
        self.outstanding += 1
        return RolloutTicket(pending=(prompts, spec))

    def collect(self, ticket):
        if ticket.samples is not None:
            return ticket.samples
        self.outstanding -= 1
        return self.generate(*ticket.pending)

    def logprobs_replicas_later(self, sequences):
        return Pending(lambda: self.logprobs_replicas(sequences))


class Counted:
    """`inner` with every method call counted in `calls` (attribute reads pass through uncounted)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, Counter()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)
        return call


class Trainer:
    """A tiny causal LM standing in for the actor: `step()` moves its weights (one "update") and keeps a copy of
    every version's weights, so a batch's log-probs can be checked against the version it claims."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.versions = [self._weights()]
        self.generator = torch.Generator().manual_seed(0)

    def _weights(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def step(self) -> int:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=self.generator))
        self.versions.append(self._weights())
        return len(self.versions) - 1

    def logprobs_at(self, version: int, sample) -> list[float]:
        now = self._weights()
        self.model.load_state_dict(self.versions[version])
        try:
            out = trainer_logprobs(self.model, sample.prompt_ids + sample.response_ids)
        finally:
            self.model.load_state_dict(now)
        return out[len(sample.prompt_ids) - 1:]


def _rows():
    while True:
        yield from ([{"input_ids": p} for p in PROMPTS[i:i + 2]] for i in (0, 2))


def _spec(step: int) -> SamplingSpec:
    return SamplingSpec(n=2, max_new_tokens=6, seed=1000 + step)


def _service(tiny_model_path, *, asynchronous, steps, overlap=True, trainer=None, drawn=0):
    """(trainer, engine, counted sync, service); `drawn`: prompt batches already drawn (a restored loader)."""
    trainer = trainer or Trainer(tiny_model_path)
    engine = DeferringEngine(str(tiny_model_path), dtype="float32", device="cpu", batch_size=4)
    sync = Counted(WeightSync(trainer.model, engine, bucket_bytes=1 << 16, canary=SyncCanary(PROBE)))
    rows = _rows()
    for _ in range(drawn):
        next(rows)
    service = RolloutService(engine, sync, prompts=lambda: next(rows), spec=_spec, total_steps=steps,
                             asynchronous=asynchronous, overlap_sync=overlap)
    return trainer, engine, sync, service


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_async_batch_comes_from_confirmed_weights_and_the_next_one_is_in_flight(tiny_model_path):
    trainer, engine, sync, service = _service(tiny_model_path, asynchronous=True, steps=5)
    service.start(0)
    confirmed = {0}  # versions whose sync was confirmed (the first sync waits)
    deferred = []
    versions = []
    for step in range(5):
        acks = engine.acks
        batch = service.batch(step)
        if engine.acks > acks:  # the sync that was owed was confirmed in this call
            confirmed.add(deferred.pop(0))
        assert batch.weights_version in confirmed, "a batch came back before its weights' sync was confirmed"
        assert not sync.pending or service.engine_version > batch.weights_version
        versions.append(batch.weights_version)
        for s in batch.samples:  # generated with exactly those weights
            assert _max_diff(trainer.logprobs_at(batch.weights_version, s), s.logprobs) < TOL
        if step + 1 < 5:  # the next step's batch is in flight, with the weights the engine holds now
            assert engine.outstanding == 1 and service.in_flight.weights_version == service.engine_version
        else:
            assert engine.outstanding == 0 and service.in_flight is None
        if sync.pending:
            deferred.append(service.engine_version)
        service.publish(trainer.step())
    assert versions == [0, 0, 1, 2, 3]  # one step off-policy
    # the weights really moved between versions: the check above can tell them apart
    s = batch.samples[0]
    assert _max_diff(trainer.logprobs_at(batch.weights_version - 1, s), s.logprobs) > 1e-3
    # versions 1-3 were handed over without waiting, each confirmed once, by the batch generated with them
    assert confirmed == {0, 1, 2, 3} and not deferred
    assert sync.calls["sync"] == 4 and sync.calls["confirm"] == 3 and not sync.pending


def test_a_deferred_publish_is_confirmed_exactly_once_before_the_next_batch(tiny_model_path):
    trainer, engine, sync, service = _service(tiny_model_path, asynchronous=False, steps=3)
    service.start(0)
    reports = []
    for step in range(3):
        batch = service.batch(step)
        assert not sync.pending and batch.weights_version == step  # on-policy, its sync confirmed
        for s in batch.samples:
            assert _max_diff(trainer.logprobs_at(step, s), s.logprobs) < TOL
        service.publish(trainer.step())
        reports.append(service.take_report())
    # publish(1) and publish(2) handed over without waiting (another step followed), publish(3) waited
    assert [r.get("deferred", 0) for r in reports] == [1, 1, 0]
    assert sync.calls["sync"] == 4 and sync.calls["confirm"] == 2
    assert engine.acks == 4  # every load acknowledged: the two waited syncs' at once, the others' when confirmed
    canary = sync.inner.canary.history
    assert len(canary) == 4 and all(c["max_abs_diff"] < TOL for c in canary)
    # each confirmation is reported with the step that trains on the batch of those weights
    assert reports[1]["canary_max_abs_diff"] == canary[1]["max_abs_diff"]
    assert reports[2]["canary_max_abs_diff"] == canary[3]["max_abs_diff"]  # its own (waited) sync's, the latest
    assert reports[2]["confirm_seconds"] >= 0  # and the confirmation of publish(2)


def test_quiesce_leaves_nothing_owed_and_state_dict_is_pure(tiny_model_path):
    trainer, engine, sync, service = _service(tiny_model_path, asynchronous=True, steps=6)
    service.start(0)
    service.batch(0)
    service.publish(trainer.step())
    service.batch(1)  # syncs version 1 without waiting, then submits step 2's batch behind it
    assert engine.outstanding == 1 and sync.pending
    service.engine = counted = Counted(service.engine)
    with pytest.raises(RuntimeError, match="quiesce"):  # a batch still generating is not state
        service.state_dict()
    assert not counted.calls and engine.outstanding == 1 and sync.pending
    service.quiesce()
    assert engine.outstanding == 0 and not sync.pending  # nothing owed by the engine
    assert service.in_flight is not None and service.in_flight.result.ready  # the batch kept, finished
    calls, syncs = Counter(counted.calls), Counter(sync.calls)
    first, second = service.state_dict(), service.state_dict()
    assert first == second and first["in_flight"]["weights_version"] == 1
    assert counted.calls == calls and sync.calls == syncs and engine.outstanding == 0  # state_dict touched nothing

    # a fresh service (its loader restored: 3 batches drawn) loaded from it returns the same batch, then goes on
    # as the first one does
    _, _, _, restored = _service(tiny_model_path, asynchronous=True, steps=6, trainer=trainer, drawn=3)
    restored.load_state_dict(first)
    assert restored.state_dict() == first
    restored.start(1)  # a resumed run's first sync: the trainer's weights after 1 update
    ours, theirs = service.batch(2), restored.batch(2)
    assert [s.response_ids for s in ours.samples] == [s.response_ids for s in theirs.samples]
    assert theirs.weights_version == ours.weights_version == 1 and theirs.generation is None
    service.quiesce()
    restored.quiesce()
    assert [s.response_ids for s in service.in_flight.result.result()[0]] == \
        [s.response_ids for s in restored.in_flight.result.result()[0]]


def test_batch_with_rows_generates_them_now_and_the_engine_sleeps_after_an_awake_block(tiny_model_path):
    """Dynamic sampling's rounds: given rows, generated at once with the given spec; inside `awake()` a sleeping
    engine is not put to sleep between them, only at the end."""
    trainer, engine, sync, service = _service(tiny_model_path, asynchronous=False, steps=2)
    service.sleeps = True
    service.start(0)
    rows = [{"input_ids": p} for p in PROMPTS[:1]]
    service.batch(0, rows=rows, spec=_spec(7))
    assert engine.sleeping  # after a batch, outside an awake() block
    with service.awake():
        first = service.batch(0, rows=rows, spec=_spec(7))
        assert not engine.sleeping
        second = service.batch(0, rows=rows, spec=_spec(7))
        assert not engine.sleeping
    assert engine.sleeping
    assert [s.response_ids for s in first.samples] == [s.response_ids for s in second.samples]
    assert len(first.samples) == 2 and first.weights_version == 0 and service.in_flight is None
