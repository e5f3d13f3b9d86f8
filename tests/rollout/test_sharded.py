"""Several sidecar vLLM engines behind one `ShardedRolloutEngine` (`rollout.sidecar_engines`): how the batch is cut,
which seeds each shard gets, the memory split and seeds the factory gives each server, and (two real servers on CPU)
the rollout contract, a weight sync into both, and the canary seeing a server that missed a sync."""

from __future__ import annotations

import types

import pytest
import torch
from rollout_helpers import (
    PROBE,
    STALE_MIN,
    TOL,
    check_generate_contract,
    restore_checkpoint_weights,
    skipped_sync_fires,
    sync_roundtrip,
)

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout.base import Pending, RolloutError, RolloutTicket, SamplingSpec, batch_seed
from ds_rlhf.rollout.server.sharded import shard_bounds, shard_spec


@pytest.mark.parametrize(("prompts", "engines", "expected"), [
    (32, 3, [(0, 10), (10, 21), (21, 32)]),
    (8, 2, [(0, 4), (4, 8)]),
    (2, 4, [(0, 1), (1, 2)]),  # fewer prompts than engines: one prompt each, the rest idle
    (5, 1, [(0, 5)]),
    (0, 2, [(0, 0)]),
])
def test_shard_bounds_cover_every_prompt_once_in_order(prompts, engines, expected):
    bounds = shard_bounds(prompts, engines)
    assert bounds == expected
    assert [i for a, b in bounds for i in range(a, b)] == list(range(prompts))


def test_shard_specs_keep_request_seeds_and_give_each_batch_shard_its_own():
    spec = SamplingSpec(n=4, seed=100)
    for offset in (0, 3, 7):
        shifted = shard_spec(spec, offset)
        # prompt `offset + i` keeps the seed it has when one engine serves the whole batch
        assert [shifted.request_seed(i) for i in range(3)] == [spec.request_seed(offset + i) for i in range(3)]
    batch = SamplingSpec(n=4, seed=100, seeding="batch")
    seeds = [batch_seed([shard_spec(batch, o)]) for o in (0, 10, 21)]
    assert len(set(seeds)) == 3 and seeds[0] == batch_seed([batch])
    assert shard_spec(SamplingSpec(n=4), 5).seed is None  # unseeded stays unseeded


def test_sidecar_engines_needs_the_sidecar_placement():
    with pytest.raises(ConfigError, match=r"rollout.sidecar_engines=2 .*--rollout.placement sidecar"):
        parse_config(["--rollout.sidecar_engines", "2"])
    with pytest.raises(ConfigError, match="sidecar_engines"):
        parse_config(["--rollout.sidecar_engines", "0", "--rollout.placement", "sidecar"])
    cfg = parse_config(["--rollout.sidecar_engines", "3", "--rollout.placement", "sidecar"])
    assert cfg.rollout.sidecar_engines == 3


def _fake_servers(monkeypatch, remote_cls):
    """`spawn_servers` and `RemoteVLLMEngine` replaced: the returned state records the servers spawned (their log
    paths and extra environments), the processes closed and, through `remote_cls(state)`, the engines started."""
    from types import SimpleNamespace

    from ds_rlhf.rollout import factory
    from ds_rlhf.rollout.server import client as remote_mod
    from ds_rlhf.rollout.server import process as server_process

    state = SimpleNamespace(spawned=[], envs=[], started=[], closed=[], processes_closed=[], spawned_when_started=[])

    class FakeProcess:
        def __init__(self, i):
            self.i = i

        def close(self):
            state.processes_closed.append(self.i)

    def fake_spawn(n, *, devices=None, log_paths=(), host="127.0.0.1", extra_env=None):
        state.spawned.extend(log_paths)
        state.envs.append(extra_env)
        return [FakeProcess(i) for i in range(n)]

    monkeypatch.setattr(server_process, "spawn_servers", fake_spawn)
    monkeypatch.setattr(remote_mod, "RemoteVLLMEngine", remote_cls(state))
    monkeypatch.setattr(factory, "resolve_backend", lambda backend: "vllm")
    return state


def test_factory_closes_the_started_servers_when_one_fails_to_start(monkeypatch, tiny_model_path):
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.base import RolloutError

    def remote(state):
        class FakeRemote:
            def __init__(self, model_path, *, process, **kw):
                state.spawned_when_started.append(len(state.spawned))
                if len(state.started) == 1:
                    raise RolloutError("second server failed to start")
                assert process.i == len(state.started)  # engine i takes server i over
                state.started.append(kw)

            def close(self):
                state.closed.append(True)
        return FakeRemote

    state = _fake_servers(monkeypatch, remote)
    with pytest.raises(RolloutError, match="second server"):
        make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), gpu_memory_utilization=0.6, seed=5,
                            sidecar_engines=3, log_path="/tmp/server.log")
    assert state.spawned == ["/tmp/server.log.0", "/tmp/server.log.1", "/tmp/server.log.2"]
    assert state.spawned_when_started == [3, 3]  # every server runs (importing vLLM) before the first engine starts
    assert [kw["gpu_memory_utilization"] for kw in state.started] == [pytest.approx(0.2)]
    assert [kw["log_path"] for kw in state.started] == ["/tmp/server.log.0"]
    # the engine started, the failed server and the last
    assert len(state.closed) == 1 and state.processes_closed == [1, 2]


def test_factory_splits_the_memory_seeds_and_environment_over_the_servers(monkeypatch, tiny_model_path):
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.server import sharded as sharded_mod

    def remote(state):
        class Starts:
            def __init__(self, model_path, *, process, **kw):
                state.started.append(kw)
        return Starts

    state = _fake_servers(monkeypatch, remote)
    monkeypatch.setattr(sharded_mod, "ShardedRolloutEngine", lambda engines: engines)
    engines = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), gpu_memory_utilization=0.6,
                                  seed=5, sidecar_engines=3, server_env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"})
    assert len(engines) == 3
    assert state.envs == [{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}]  # every server spawned gets the split's share
    assert [kw["gpu_memory_utilization"] for kw in state.started] == [pytest.approx(0.2)] * 3
    assert [kw["seed"] for kw in state.started] == [5, 6, 7]  # unseeded requests must not repeat across shards
    with pytest.raises(ValueError, match="placement='sidecar'"):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), sidecar_engines=2)


def test_a_spawned_server_imports_vllm_before_its_turn_and_close_stops_it(tmp_path):
    """The client accepts a server's connection only when that server's engine is built, so the import must not
    wait for it: the server logs the import done while nobody has accepted its connection yet."""
    import time

    from ds_rlhf.rollout.server.process import spawn_servers
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")
    log = tmp_path / "server.log"
    process = spawn_servers(1, log_paths=[str(log)])[0]
    try:
        deadline = time.monotonic() + 180
        while "vLLM imported" not in log.read_text() and time.monotonic() < deadline:
            assert process.proc.poll() is None, log.read_text()
            time.sleep(0.5)
        assert "before connecting" in log.read_text()  # not accepted: it waits for its turn, alive
        assert process.proc.poll() is None
        conn = process.connect(timeout=60)
    finally:
        process.close()
    assert process.proc.poll() is not None and process.log.closed
    conn.close()
    process.close()  # twice is harmless (the factory may close a server an engine already closed)


class FakeServer:
    """A RemoteVLLMEngine stand-in: queued commands, scores `offset` away from `truth`, failures on demand."""

    defers_replies = True  # one training rank
    weight_backend = "gloo"
    weights = types.SimpleNamespace(dtype=torch.float32)

    def __init__(self, truth=None, offset=0.0, fail_score=False, fail_submit=False):
        self.truth, self.offset, self.fail_score, self.fail_submit = truth, offset, fail_score, fail_submit
        self.queue, self.in_flight, self.collected = [], False, 0

    def stats(self):
        return {"vllm_version": "fake"}

    def send_command(self, *msg):
        self.queue.append(msg)
        return Pending(self._reply)

    def _reply(self):
        cmd, seqs = self.queue.pop(0)
        if self.fail_score:
            raise RolloutError("server failed")
        return [[x + self.offset for x in self.truth] for _ in seqs]

    def submit(self, prompts, spec):
        if self.fail_submit:
            raise RolloutError("submit failed")
        self.in_flight = True
        return RolloutTicket(pending=True)

    def collect(self, ticket):
        self.in_flight, self.collected = False, self.collected + 1
        return []

    def last_generate(self):
        return (0.1, 0)


@pytest.mark.parametrize("stale", [0, 1])
def test_the_canary_checks_every_server_whichever_missed_the_sync(stale, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from ds_rlhf.rollout import SyncCanary
    from ds_rlhf.rollout.server.sharded import ShardedRolloutEngine
    from ds_rlhf.rollout.weights.canary import trainer_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    truth = trainer_logprobs(model, PROBE)
    servers = [FakeServer(truth, offset=0.5 if i == stale else 0.0) for i in range(2)]
    info = SyncCanary(PROBE, threshold=1e-3).measure(model, ShardedRolloutEngine(servers))
    assert info["max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    fine = SyncCanary(PROBE, threshold=1e-3).measure(model, ShardedRolloutEngine([FakeServer(truth)] * 2))
    assert fine["max_abs_diff"] < 1e-6


def test_a_failing_server_leaves_no_reply_unread_and_no_shard_in_flight():
    from ds_rlhf.rollout.server.sharded import ShardedRolloutEngine

    bad, good = FakeServer([0.0], fail_score=True), FakeServer([0.0])
    engine = ShardedRolloutEngine([bad, good])
    with pytest.raises(RolloutError, match="server failed"):
        engine.logprobs([[1, 2]])
    assert bad.queue == [] and good.queue == []  # the good server's reply was read too
    first, broken = FakeServer(), FakeServer(fail_submit=True)
    engine = ShardedRolloutEngine([first, broken])
    with pytest.raises(RolloutError, match="submit failed"):
        engine.submit([[1], [2]], SamplingSpec(seed=1))
    assert first.collected == 1 and not first.in_flight  # the shard already sent was waited out
    broken.fail_submit = False
    ticket = engine.submit([[1], [2]], SamplingSpec(seed=1))  # the engine is usable again
    assert engine.collect(ticket) == [] and (first.collected, broken.collected) == (2, 1)


@pytest.fixture(scope="module")
def two_sidecars(tiny_model_path, tmp_path_factory):
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")
    log = tmp_path_factory.mktemp("sidecars") / "server.log"
    engine = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), dtype="float32",
                                 max_model_len=256, seed=0, sidecar_engines=2, log_path=str(log))
    yield engine
    engine.close()


@pytest.mark.slow
def test_two_sidecar_engines_keep_the_rollout_contract(two_sidecars, tiny_model_path):
    from transformers import AutoTokenizer

    check_generate_contract(two_sidecars, AutoTokenizer.from_pretrained(str(tiny_model_path)).eos_token_id)
    # both servers generated: each holds its share of the calls' samples
    per_engine = [e["samples"] for e in two_sidecars.stats()["engines"]]
    assert all(n > 0 for n in per_engine) and sum(per_engine) == two_sidecars.stats()["samples"]
    seconds, tokens = two_sidecars.last_generate()
    assert seconds > 0 and tokens == 3 * 8  # the last contract call: 3 prompts x 8 tokens over both servers


@pytest.mark.slow
def test_a_sync_reaches_both_servers_and_the_canary_sees_one_that_missed_it(two_sidecars, tiny_model_path,
                                                                           dist_single):
    r = sync_roundtrip(two_sidecars, tiny_model_path, stage=0)
    assert r["initial"] < TOL and r["stale"] > STALE_MIN and r["after"] < TOL and r["gen_diff"] < TOL, r
    # every server scores the probe alike after the sync
    first, second = (e.logprobs([PROBE])[0] for e in two_sidecars.engines)
    assert max(abs(a - b) for a, b in zip(first, second)) < TOL
    assert "not serving the trained weights" in skipped_sync_fires(two_sidecars, tiny_model_path, stage=0)
    # only one server gets the trained weights (either one): the canary checks both, so it fires
    from ds_rlhf.rollout import SyncCanary, SyncCanaryError

    trained = list(r["engine"].module.named_parameters())
    for synced in (0, 1):
        restore_checkpoint_weights(two_sidecars, tiny_model_path)
        two_sidecars.engines[synced].weights.load(trained)
        with pytest.raises(SyncCanaryError):
            SyncCanary(PROBE, threshold=1e-3).check(r["engine"], two_sidecars)
    two_sidecars.engines[0].weights.load(trained)
    assert SyncCanary(PROBE, threshold=1e-3).measure(r["engine"], two_sidecars)["max_abs_diff"] < TOL


@pytest.mark.slow
def test_a_sync_without_waiting_is_loaded_before_the_next_generation_and_confirmed_after_it(
        two_sidecars, tiny_model_path, dist_single):
    """`WeightSync.sync(wait=False)` (async generation with overlap): the trainer hands the weights over and sends
    the canary probe without waiting; a generation submitted right after runs on the new weights in both servers,
    and `confirm()` then reports the canary. A load that fails on a server is raised by `confirm()`, and the
    servers' reply streams stay in step."""
    from rollout_helpers import build_engine, train

    from ds_rlhf.rollout import SamplingSpec, SyncCanary, WeightSync
    from ds_rlhf.rollout.weights.canary import trainer_logprobs

    restore_checkpoint_weights(two_sidecars, tiny_model_path)
    engine = build_engine(tiny_model_path, 0)
    train(engine)
    sync = WeightSync(engine, two_sidecars, canary=SyncCanary(PROBE, threshold=1e-3))
    info = sync.sync(wait=False)
    assert info["deferred"] == 1 and info["canary_max_abs_diff"] is None
    # nothing waited for the servers: each still owes the update's and the probe's replies
    assert [len(e._unread) for e in two_sidecars.engines] == [2, 2]
    prompts = [[1, 5, 6, 7, 8], [2, 9, 10, 11]]
    ticket = two_sidecars.submit(prompts, SamplingSpec(max_new_tokens=12, seed=3, ignore_eos=True))
    two_sidecars.wake()  # what the schedule may call before a submit: an awake engine must not read them either
    assert [len(e._unread) for e in two_sidecars.engines] == [3, 3]
    samples = two_sidecars.collect(ticket)
    for s in samples:  # both shards sampled with the synced weights
        ref = trainer_logprobs(engine, s.prompt_ids + s.response_ids)[len(s.prompt_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(ref, s.logprobs)) < TOL
    confirmed = sync.confirm()
    assert confirmed["canary_max_abs_diff"] < TOL and sync.history[-1]["canary_max_abs_diff"] < TOL
    assert confirmed["engine_load_seconds"] > 0  # the slowest server's own loading time, from its acknowledgement
    assert sync.confirm() is None  # nothing left to confirm

    bad = two_sidecars.weights.send([[("model.no_such_layer.weight", torch.zeros(2, 2))]], wait=False)
    samples = two_sidecars.generate(prompts, SamplingSpec(max_new_tokens=4, seed=3, ignore_eos=True))
    assert len(samples) == len(prompts)  # the generation's reply was read past the failed load's
    with pytest.raises(RolloutError, match="no_such_layer"):
        bad.result()
    assert len(two_sidecars.logprobs([PROBE])[0]) == len(PROBE) - 1  # both servers still answer in step
