"""RolloutSchedule's first sync: a colocated GPU engine that sleeps between phases is asleep when the first weight
sync runs, so the sync wakes its weights only (the KV cache stays free while the trainer gathers its weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.rollout.base import RolloutEngine
from ds_rlhf.telemetry import PhaseTimer
from ds_rlhf.trainer.rollout_schedule import RolloutSchedule


class Engine(RolloutEngine):
    def generate(self, prompts, spec):
        raise NotImplementedError

    def score(self, sequences):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


class RecordingSync:
    def __init__(self, rollout):
        self.rollout, self.seen = rollout, []

    def sync(self, wait=True):
        self.seen.append(self.rollout.sleeping)
        return {"seconds": 0.0}

    def confirm(self):
        return None


def _schedule(device: str, *args: str):
    cfg = parse_config(list(args))
    rollout = Engine()
    parts = SimpleNamespace(rollout=rollout, sync=RecordingSync(rollout))
    ctx = SimpleNamespace(cfg=cfg, dist=SimpleNamespace(device=torch.device(device)))
    return RolloutSchedule(parts, ctx, PhaseTimer(), start_step=0), parts


@pytest.mark.parametrize(("device", "args", "asleep"), [
    ("cuda", (), True),                                         # colocated, rollout.sleep true (the defaults)
    ("cuda", ("--rollout.sleep", "false"), False),
    ("cuda", ("--rollout.placement", "sidecar", "--rollout.async_generation", "true"), False),
    ("cpu", (), False),                                         # no sleep on CPU
])
def test_first_sync_runs_with_a_sleeping_colocated_engine(device, args, asleep):
    schedule, parts = _schedule(device, *args)
    assert not parts.rollout.sleeping
    schedule.first_sync(0)
    assert parts.sync.seen == [asleep]
    assert schedule.engine_version == 0


class PartitionedEngine:
    def __init__(self, calls):
        self.calls = calls

    def empty_partition_cache(self):
        self.calls.append("released")


@pytest.mark.parametrize(("device", "released"), [("cuda", True), ("cpu", False)])
def test_sync_releases_zero3_partition_caches_before_a_colocated_engine_wakes(device, released):
    schedule, parts = _schedule(device)
    calls = []
    parts.actor, parts.critic, parts.reference = PartitionedEngine(calls), PartitionedEngine(calls), object()
    schedule.sync(1)
    assert calls == (["released", "released"] if released else [])
    assert schedule.engine_version == 1
