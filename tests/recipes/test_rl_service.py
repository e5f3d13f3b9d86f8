"""The run's RolloutService as the RL recipe builds it (`rl_service.rollout_service`): a colocated GPU engine
that sleeps between phases is asleep when the first weight sync runs, so the sync wakes its weights only (the KV
cache stays free while the trainer gathers its weights); the trainer's caches are released before such an engine
wakes; and the order of submits, collects, syncs and confirmations in both modes with `rollout.overlap_sync`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.recipes.rl_service import rollout_service
from ds_rlhf.rollout.base import RolloutEngine, RolloutTicket
from ds_rlhf.rollout.service import merge_reports
from ds_rlhf.telemetry import PhaseTimer


class Engine(RolloutEngine):
    def generate(self, prompts, spec):
        raise NotImplementedError

    def logprobs(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


class RecordingSync:
    def __init__(self, rollout):
        self.rollout, self.seen = rollout, []

    pending = False

    def sync(self, wait=True):
        self.seen.append(self.rollout.sleeping)
        return {"seconds": 0.0}

    def confirm(self):
        return None


def _service(device: str, *args: str):
    cfg = parse_config(list(args))
    rollout = Engine()
    parts = SimpleNamespace(environment=None, rollout=rollout, sync=RecordingSync(rollout), loader_iter=iter([]))
    ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device(device)))
    return rollout_service(parts, ctx, PhaseTimer()), parts


@pytest.mark.parametrize(("device", "args", "asleep"), [
    ("cuda", (), True),                                         # colocated, rollout.sleep true (the defaults)
    ("cuda", ("--rollout.sleep", "false"), False),
    ("cuda", ("--rollout.placement", "sidecar", "--rollout.async_generation", "true"), False),
    ("cpu", (), False),                                         # no sleep on CPU
])
def test_first_sync_runs_with_a_sleeping_colocated_engine(device, args, asleep):
    service, parts = _service(device, *args)
    assert not parts.rollout.sleeping
    service.start(0)
    assert parts.sync.seen == [asleep]
    assert service.engine_version == 0


class PartitionedEngine:
    def __init__(self, calls):
        self.calls = calls

    def empty_partition_cache(self):
        self.calls.append("released")


@pytest.mark.parametrize(("device", "released"), [("cuda", True), ("cpu", False)])
def test_sync_releases_zero3_partition_caches_before_a_colocated_engine_wakes(device, released):
    service, parts = _service(device)
    calls = []
    parts.actor, parts.critic, parts.reference = PartitionedEngine(calls), PartitionedEngine(calls), object()
    service.start(1)
    assert calls == (["released", "released"] if released else [])
    assert service.engine_version == 1


class ServerLikeEngine(Engine):
    """An engine in another process, as the service sees it: submit returns a ticket, collect its samples."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def wake(self, tags=None):
        self.calls.append("wake")
        super().wake(tags)

    def submit(self, prompts, spec):
        self.calls.append("submit")
        return RolloutTicket(pending=True)

    def collect(self, ticket):
        self.calls.append("collect")
        return []


class DeferringSync:
    """WeightSync's contract with `wait=False`: `sync` hands over, `confirm` gives the canary's figures once."""

    def __init__(self, calls):
        self.calls, self.owed = calls, None

    @property
    def pending(self):
        return self.owed is not None

    def sync(self, wait=True):
        self.calls.append(f"sync(wait={wait})")
        self.owed = None if wait else {"canary_max_abs_diff": 0.01, "confirm_seconds": 0.0}
        return {"seconds": 0.002, "deferred": int(not wait), "canary_max_abs_diff": None}

    def confirm(self):
        self.calls.append("confirm")
        out, self.owed = self.owed, None
        return out


def recording_service(cfg, calls: list):
    """The rollout service of `cfg` over a server-like engine and a deferring sync, both recording into `calls`."""
    parts = SimpleNamespace(environment=None, rollout=ServerLikeEngine(calls), sync=DeferringSync(calls),
                            loader_iter=iter([[{"input_ids": [1]}]] * 4))
    ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0),
                          tokenizer=SimpleNamespace(eos_token_id=0))
    return rollout_service(parts, ctx, PhaseTimer())


@pytest.mark.parametrize("overlap", [True, False])
def test_async_sync_is_confirmed_when_its_batch_is_collected_and_reported_with_it(overlap):
    """With rollout.overlap_sync the step's sync does not wait; the engine is not woken (it is awake: a call would
    wait for the owed replies); the next collect confirms it before the batch goes on, and that step's report
    carries the canary of the weights that generated its batch."""
    calls = []
    cfg = parse_config(["--rollout.placement", "sidecar", "--rollout.async_generation", "true", "--run.steps", "3",
                        "--rollout.overlap_sync", str(overlap)])
    service = recording_service(cfg, calls)
    reports = []
    for step in range(3):
        service.batch(step)
        service.publish(step + 1)  # async: nothing moves here
        reports.append(service.take_report())
    assert "wake" not in calls
    sync_call = f"sync(wait={not overlap})"
    confirm = ["confirm"] if overlap else []  # only a sync that did not wait is confirmed
    assert calls == ["submit", "collect", "submit",                        # step 0: staleness 1 allows no sync yet
                     "collect", sync_call, "submit",                       # step 1: sync, then the next batch
                     "collect", *confirm]                                  # step 2 (last): its batch's sync confirmed
    assert reports[0] is None
    assert reports[1]["deferred"] == int(overlap)
    if overlap:
        assert reports[2]["canary_max_abs_diff"] == 0.01
    else:
        assert reports[2] is None


@pytest.mark.parametrize("overlap", [True, False])
def test_synchronous_sync_hands_over_after_every_update_but_the_last_and_is_confirmed_at_the_collect(overlap):
    """Synchronous mode with rollout.overlap_sync: the sync after an update does not wait while another step
    follows; the next step's collect confirms it before its batch goes on, and that step's report carries both the
    confirmed canary and its own handover. The last step's sync waits. `quiesce` (evaluation) confirms too."""
    calls = []
    cfg = parse_config(["--rollout.placement", "sidecar", "--run.steps", "3", "--rollout.overlap_sync", str(overlap)])
    service = recording_service(cfg, calls)
    reports = []
    for step in range(3):
        service.batch(step)
        service.publish(step + 1)
        reports.append(service.take_report())
        if step == 0:
            service.quiesce(step + 1)  # an evaluation after step 1: the deferred sync is checked before it generates
    wait = f"sync(wait={not overlap})"
    confirm = ["confirm"] if overlap else []
    assert calls == ["submit", "collect", wait, *confirm,                        # step 1, then the evaluation's
                     "submit", "collect", wait,                                  # step 2
                     "submit", "collect", *confirm, "sync(wait=True)"]           # step 3: the last sync waits
    assert [r["deferred"] for r in reports] == [int(overlap), int(overlap), 0]
    # step 3 trains on the batch of step 2's deferred sync: its report has that canary next to its own handover
    assert reports[2]["canary_max_abs_diff"] == (0.01 if overlap else None)
    assert reports[1]["canary_max_abs_diff"] == (0.01 if overlap else None)  # step 1's, confirmed by the evaluation


def test_merge_reports_keeps_a_confirmed_value_a_later_none_would_hide():
    assert merge_reports(None, None) is None
    assert merge_reports({"canary": 0.01, "seconds": 0.2}, {"canary": None, "seconds": 0.1, "deferred": 1}) == \
        {"canary": 0.01, "seconds": 0.1, "deferred": 1}
    assert merge_reports({"canary": None}, None) == {"canary": None}
