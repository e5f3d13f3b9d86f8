"""`rollout.weight_transport` (own | vllm): the setting's validation, the vLLM engine keyword it adds (only when
chosen, through the sidecar's and the disaggregated server's 'start': IPC / NCCL backend), the refusals (colocated,
HF, CPU), the missing-package message of vLLM's IPC engine import, the bucket stream handed to vLLM's producers, the
NCCL engine's init / update infos, and the order of the trainer's and the server's NCCL calls (each side's
blocking call must be in flight before the other makes its own). The transfer itself needs CUDA:
`tests/gpu/test_vllm_weight_transport.py`. `vllm.LLM` is replaced by a recorder that stops before an engine starts;
in the ordering tests vLLM's NCCL calls are replaced by rendezvous that time out when the peer's call was not sent."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from rollout_helpers import LLMBuilt

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout import make_rollout_engine, vllm_transfer
from ds_rlhf.rollout.base import Pending, RolloutError, TensorMeta
from ds_rlhf.rollout.server import client as remote
from ds_rlhf.rollout.server import server as remote_server
from ds_rlhf.rollout.server.client import RemoteVLLMEngine
from ds_rlhf.rollout.server.transports import VLLMNCCL
from ds_rlhf.rollout.vllm_adapter import engine_arg_names
from ds_rlhf.rollout.vllm_mapping import (
    named_tensors_from_buckets,
    nccl_update_info,
    nccl_wire,
    nccl_worker_init_info,
    transfer_buffer_bytes,
    update_info_nbytes,
    weight_transfer_kwargs,
)
from ds_rlhf.rollout.weights.group import bucket_nbytes
from ds_rlhf.run.placement import resolve_placement

pytest.importorskip("vllm")

SIDECAR_VLLM = ["--rollout.placement", "sidecar", "--rollout.weight_transport", "vllm"]


# ---- the setting ----------------------------------------------------------------------------------------------------
DISAGG_VLLM = ["--rollout.placement", "disaggregated", "--rollout.devices", "1", "--rollout.weight_transport", "vllm"]


def test_default_is_own_and_vllm_is_accepted_on_the_sidecar_and_disaggregated():
    assert parse_config([]).rollout.weight_transport == "own"
    assert parse_config(SIDECAR_VLLM).rollout.weight_transport == "vllm"
    assert parse_config(DISAGG_VLLM).rollout.weight_transport == "vllm"


@pytest.mark.parametrize("argv, message", [
    (["--rollout.weight_transport", "vllm"], "rollout.weight_transport=vllm .* rollout.placement=colocated"),
    ([*SIDECAR_VLLM, "--rollout.backend", "hf"], "rollout.backend=hf"),
    (["--rollout.weight_transport", "nccl"], "rollout.weight_transport='nccl': choose one of own, vllm"),
])
def test_vllm_transport_outside_the_sidecar_is_refused_naming_the_setting(argv, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_sidecar_placement_hands_the_transport_to_the_engine_on_gpu_and_refuses_it_on_cpu():
    cfg = parse_config(SIDECAR_VLLM)
    kw = resolve_placement(cfg, world_size=1, local_world_size=1, gpus_on_node=1).engine_kwargs()
    assert kw["weight_transport"] == "vllm" and kw["weight_backend"] == "ipc"
    own = resolve_placement(parse_config(["--rollout.placement", "sidecar"]), world_size=1, local_world_size=1,
                            gpus_on_node=1).engine_kwargs()
    assert "weight_transport" not in own
    with pytest.raises(ConfigError, match="rollout.weight_transport=vllm .* no GPU .*weight_transport own"):
        resolve_placement(cfg, world_size=1, local_world_size=1, gpus_on_node=0)


def test_disaggregated_placement_hands_the_transport_to_the_engine_on_gpus_and_refuses_it_on_cpu():
    kw = resolve_placement(parse_config(DISAGG_VLLM), world_size=1, local_world_size=1, gpus_on_node=2).engine_kwargs()
    assert kw == {"tensor_parallel_size": 1, "devices": [1], "weight_transport": "vllm"}  # NCCL: no "ipc" backend
    cpu = parse_config(["--rollout.placement", "disaggregated", "--rollout.weight_transport", "vllm"])
    with pytest.raises(ConfigError, match="weight_transport=vllm moves weights over NCCL, .* no GPU .*own") as info:
        resolve_placement(cpu, world_size=1, local_world_size=1, gpus_on_node=0)
    assert "\n" not in str(info.value)


# ---- the engine keyword ---------------------------------------------------------------------------------------------
def test_weight_transfer_config_only_when_vllm_is_chosen():
    names = engine_arg_names()
    assert "weight_transfer_config" in names  # the installed vLLM has the engine argument
    assert weight_transfer_kwargs("own", version="x", arg_names=names) == {}
    assert weight_transfer_kwargs("vllm", version="x", arg_names=names) == {
        "weight_transfer_config": {"backend": "ipc"}}
    with pytest.raises(RolloutError, match=r"vLLM 0\.25\.0 has no weight_transfer_config .*weight_transport own"):
        weight_transfer_kwargs("vllm", version="0.25.0", arg_names=names - {"weight_transfer_config"})
    assert weight_transfer_kwargs("vllm", version="x", arg_names=names, backend="nccl") == {
        "weight_transfer_config": {"backend": "nccl"}}
    assert weight_transfer_kwargs("own", version="x", arg_names=names, backend="nccl") == {}
    with pytest.raises(RolloutError, match="no vLLM weight-transfer backend 'gloo'"):
        weight_transfer_kwargs("vllm", version="x", arg_names=names, backend="gloo")


def _sidecar_start_kwargs(monkeypatch, tiny_model_path, placement="sidecar", weight_backend="ipc", **kw) -> dict:
    """The keywords a sidecar (or disaggregated) client sends in 'start' (no server spawned)."""

    sent = {}

    def fake_start(self, process, model_path, startup_timeout_s, engine_kwargs):
        sent.update(model_path=model_path, kwargs=engine_kwargs)
        return {"error": "stopped before starting a server"}

    monkeypatch.setattr(remote, "ServerProcess", lambda **kw: None)  # nothing is spawned
    monkeypatch.setattr(RemoteVLLMEngine, "_start", fake_start)
    with pytest.raises(RolloutError, match="stopped before"):
        make_rollout_engine("vllm", placement, model_path=str(tiny_model_path), max_model_len=256,
                            weight_backend=weight_backend, **kw)
    return sent


PLACEMENTS = {"sidecar": ({}, "ipc"), "disaggregated": ({"placement": "disaggregated", "weight_backend": "nccl",
                                                          "devices": [1]}, "nccl")}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("transport", ["own", "vllm"])
def test_server_builds_llm_with_vllms_weight_transfer_engine_only_for_vllm(placement, transport, tiny_model_path,
                                                                           llm_calls, as_gpu, monkeypatch):
    """The server's `LLM(...)` gets `weight_transfer_config` with the placement's engine (sidecar: ipc,
    disaggregated: nccl) only with `weight_transport vllm`; our own settings never reach vLLM."""
    settings, backend = PLACEMENTS[placement]
    extra = {} if transport == "own" else {"weight_transport": "vllm"}
    sent = _sidecar_start_kwargs(monkeypatch, tiny_model_path, **settings, **extra)
    with pytest.raises(LLMBuilt):
        remote_server.ServerSession().handle("start", (sent["model_path"], sent["kwargs"]))
    (kw,) = llm_calls
    if transport == "own":
        assert "weight_transfer_config" not in kw
    else:
        assert kw["weight_transfer_config"] == {"backend": backend}
    assert "weight_transport" not in kw and "weight_transfer_backend" not in kw  # ours, not vLLM arguments


def test_vllm_transport_is_refused_by_engines_without_cuda(tiny_model_path, monkeypatch):

    spawned = []
    monkeypatch.setattr(remote, "ServerProcess", lambda **kw: spawned.append(kw))
    with pytest.raises(RolloutError, match="weight_transport=vllm .* need CUDA .*over gloo here.*weight_transport own"):
        RemoteVLLMEngine(str(tiny_model_path), weight_backend="gloo", weight_transport="vllm")
    assert spawned == []  # refused before a server was started
    with pytest.raises(ValueError, match="weight_transport='vllm' needs placement='sidecar' or 'disaggregated'"):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), weight_transport="vllm")


# ---- vLLM's IPC engine import ---------------------------------------------------------------------------------------
class _NoRay(importlib.abc.MetaPathFinder):
    """Imports of vLLM's ipc_engine fail as they do where `ray` is not installed (vLLM 0.26 imports it at top)."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm.distributed.weight_transfer.ipc_engine":
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return None


def test_missing_package_of_vllms_ipc_engine_is_named_in_one_line(monkeypatch):
    assert vllm_transfer.ipc_engine_module().__name__ == "vllm.distributed.weight_transfer.ipc_engine"
    monkeypatch.delitem(sys.modules, "vllm.distributed.weight_transfer.ipc_engine")
    monkeypatch.delattr(sys.modules["vllm.distributed.weight_transfer"], "ipc_engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoRay(), *sys.meta_path])
    with pytest.raises(RolloutError, match="needs the Python package 'ray', .*--rollout.weight_transport own") as info:
        vllm_transfer.ipc_engine_module()
    assert "\n" not in str(info.value)


# ---- our buckets -> vLLM's (name, tensor) stream --------------------------------------------------------------------
def _buckets():
    a, b, c = torch.arange(6.0).reshape(2, 3), torch.ones(4), torch.full((2, 2), 2.0)
    buckets = [[("a", a), ("b", b)], [("c", c)]]
    plan = [[TensorMeta("a", (2, 3), torch.bfloat16), TensorMeta("b", (4,), torch.bfloat16)],
            [TensorMeta("c", (2, 2), torch.bfloat16)]]
    return buckets, plan


def test_buckets_become_one_stream_in_plan_order_cast_to_the_plan_dtype():
    buckets, plan = _buckets()
    out = list(named_tensors_from_buckets(buckets, plan))
    assert [n for n, _ in out] == ["a", "b", "c"]
    assert all(t.dtype == torch.bfloat16 for _, t in out)
    for (_, t), (_, ref) in zip(out, [p for b in buckets for p in b]):
        assert torch.equal(t.float(), ref)
    assert transfer_buffer_bytes(plan) == (6 + 4) * 2  # the largest bucket, in the plan's dtype


def test_stream_gathers_a_bucket_only_when_the_producer_reaches_it():
    buckets, plan = _buckets()
    gathered = []

    def lazy():
        for i, b in enumerate(buckets):
            gathered.append(i)
            yield b

    stream = named_tensors_from_buckets(lazy(), plan)
    assert next(stream)[0] == "a" and gathered == [0]
    assert [n for n, _ in stream] == ["b", "c"] and gathered == [0, 1]


@pytest.mark.parametrize("change, message", [
    (lambda b, p: ([[("x", b[0][0][1]), b[0][1]], b[1]], p), "bucket 0 does not match the announced plan"),
    (lambda b, p: ([[b[0][0], ("b", torch.ones(5))], b[1]], p), r"b: shape \(5,\) differs from the announced"),
    (lambda b, p: (b[:1], p), "sent 1 buckets but announced 2"),
])
def test_buckets_that_do_not_follow_the_plan_are_refused(change, message):
    buckets, plan = change(*_buckets())
    with pytest.raises(RolloutError, match=message):
        list(named_tensors_from_buckets(buckets, plan))


# ---- vLLM's NCCL engine (disaggregated) -----------------------------------------------------------------------------
VLLM_026_NCCL_UPDATE_FIELDS = {"names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
                               "packed_num_buffers"}  # vLLM 0.26's NCCLWeightTransferUpdateInfo


def test_nccl_infos_follow_the_plan_and_parse_as_vllms():
    from vllm.distributed.weight_transfer import nccl_engine

    buckets, plan = _buckets()
    info = nccl_update_info(plan)
    assert info == {"names": ["a", "b", "c"], "dtype_names": ["bfloat16"] * 3, "shapes": [[2, 3], [4], [2, 2]]}
    assert info["names"] == [n for n, _ in named_tensors_from_buckets(buckets, plan)]  # the order sent
    assert update_info_nbytes(info) == sum(bucket_nbytes(m) for m in plan) == 28
    wire = nccl_wire(transfer_buffer_bytes(plan))
    assert set(nccl_update_info(plan, wire)) == VLLM_026_NCCL_UPDATE_FIELDS
    nccl_engine.NCCLWeightTransferUpdateInfo(**info)  # the installed vLLM's own classes take them
    worker = nccl_engine.NCCLWeightTransferInitInfo(**nccl_worker_init_info("127.0.0.1", 2345, 3))
    assert (worker.rank_offset, worker.world_size) == (1, 3)  # the trainer is rank 0, tp=2 workers 1 and 2


class _Running:
    """A server process that keeps running, as `subprocess.Popen` answers `poll()`."""

    pid, returncode = 0, None

    def poll(self):
        return None


class _Server:
    """A rollout server as `ServersWeightClient` sees it (`send_command` -> `Pending`, replies read in order). Its
    'wt_init' / 'wt_update' answer only once the trainer joined the same NCCL call, as vLLM's do; `trainer_joins`
    is the trainer's side, which, like NCCL, waits for the server's call to be in flight (2 s, then fails)."""

    host, world, timeout_s = "127.0.0.1", 1, 600.0

    def __init__(self):
        self.log, self.infos = [], {}
        self.process = _Running()  # the server process the watchdog polls
        self.sent = {c: threading.Event() for c in ("wt_init", "wt_update")}
        self.joined = {c: threading.Event() for c in ("wt_init", "wt_update")}

    def send_command(self, cmd, *args):
        self.log.append(("send", cmd))
        if args:
            self.infos[cmd] = args[0]
        if cmd in self.sent:
            self.sent[cmd].set()

        joined = self.joined.get(cmd)

        def read():
            if joined is not None and not joined.wait(2):
                raise RolloutError(f"{cmd}: the trainer never joined")
            self.log.append(("read", cmd))
            return {"load_seconds": 0.5} if cmd == "wt_finish" else None

        return Pending(read)

    def trainer_joins(self, cmd, what):
        if not self.sent[cmd].wait(2):
            raise RuntimeError(f"{what}: the server's {cmd!r} was not in flight")
        self.log.append(("trainer", what))
        self.joined[cmd].set()
        self.sent[cmd], self.joined[cmd] = threading.Event(), threading.Event()  # the next round's


def _vllm_026_nccl(server, seen):
    """vLLM 0.26's trainer side of `nccl_engine` (static `trainer_init` / `trainer_send_weights`), NCCL replaced."""

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_init(info):
            seen["trainer_init"] = info
            server.trainer_joins("wt_init", "rendezvous")
            return "group"

        @staticmethod
        def trainer_send_weights(iterator, args):
            seen["args"], seen["names"] = args, [n for n, _ in iterator]
            server.trainer_joins("wt_update", "broadcast")

    return types.SimpleNamespace(NCCLWeightTransferEngine=NCCLWeightTransferEngine)


@pytest.mark.parametrize("api", ["0.26", "installed"])
def test_nccl_sync_puts_each_blocking_server_call_in_flight_before_the_trainers(api, monkeypatch):
    server, seen = _Server(), {}
    if api == "0.26":
        monkeypatch.setattr(vllm_transfer, "nccl_engine_module", lambda: _vllm_026_nccl(server, seen))
    else:  # vLLM's own trainer engine (0.32): its threads and client calls, only the NCCL calls replaced
        mod = vllm_transfer.nccl_engine_module()
        if not hasattr(mod, "NCCLTrainerWeightTransferEngine"):
            pytest.skip("the installed vLLM has no NCCLTrainerWeightTransferEngine")

        def endpoint(info):
            seen["trainer_init"] = dataclasses.asdict(info)
            server.trainer_joins("wt_init", "rendezvous")
            return types.SimpleNamespace(destroy=lambda: None)

        def producer(iterator, **kw):
            seen["args"], seen["names"] = kw, [n for n, _ in iterator]
            server.trainer_joins("wt_update", "broadcast")

        monkeypatch.setattr(mod, "open_trainer_endpoint", endpoint)
        monkeypatch.setattr(mod, "packed_nccl_broadcast_producer", producer)
    buckets, plan = _buckets()
    transport = VLLMNCCL(server, torch.bfloat16)  # joined on the first sync, then kept
    nbytes, done = transport.send_to([server], buckets, plan, wait=False)
    assert server.log == [("send", "wt_init"), ("trainer", "rendezvous"), ("read", "wt_init"),
                          ("send", "wt_start"), ("read", "wt_start"), ("send", "wt_update"),
                          ("trainer", "broadcast"), ("read", "wt_update"), ("send", "wt_finish")]
    assert nbytes == 28 and not done.ready  # wait=False: the finish is read later
    assert done.result() == {"load_seconds": 0.5} and server.log[-1] == ("read", "wt_finish")
    assert seen["names"] == ["a", "b", "c"] and seen["trainer_init"]["world_size"] == 2  # 1 trainer + tp=1
    assert server.infos["wt_init"]["rank_offset"] == 1
    assert server.infos["wt_update"]["names"] == ["a", "b", "c"]
    if api == "0.26":
        assert server.infos["wt_update"] == nccl_update_info(plan, nccl_wire(20))
        assert seen["args"] == {"group": "group", **nccl_wire(20)}
    else:
        assert server.infos["wt_init"]["packed_buffer_size_bytes"] == 20 and server.infos["wt_init"]["packed"]
    server.log.clear()
    transport.send_to([server], buckets, plan, wait=True)  # joined once: no second rendezvous
    assert [e for e in server.log if e[0] == "send"] == [("send", "wt_start"), ("send", "wt_update"),
                                                         ("send", "wt_finish")]


# ---- the GPU bench's flag -------------------------------------------------------------------------------------------
def test_bench_passes_the_weight_transport_to_the_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))  # as when the script runs
    path = Path(__file__).resolve().parents[2] / "bench" / "rl_step_gpu.py"
    spec = importlib.util.spec_from_file_location("rl_step_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run_argv(*flags, placement="sidecar"):
        monkeypatch.setattr("sys.argv", ["rl_step_gpu.py", "--workdir", str(tmp_path), *flags])
        captured = {}
        monkeypatch.setattr(bench, "run_one", lambda args, *a, **k: captured.update(args=args))
        monkeypatch.setattr(bench, "build_model", lambda *a: tmp_path)
        monkeypatch.setattr(bench, "build_prompts", lambda *a: tmp_path)
        bench.main()
        return bench.config_argv(captured["args"], tmp_path, tmp_path, placement, tmp_path / "run", [])[0]

    assert parse_config(run_argv()).rollout.weight_transport == "own"
    assert parse_config(run_argv("--weight-transport", "vllm")).rollout.weight_transport == "vllm"
    disagg = parse_config(run_argv("--placement", "disaggregated", "--weight-transport", "vllm",
                                   placement="disaggregated"))
    assert (disagg.rollout.placement, disagg.rollout.devices, disagg.rollout.weight_transport) == (
        "disaggregated", "1", "vllm")  # the trainer on GPU 0, the server on GPU 1
    placed = resolve_placement(disagg, world_size=1, local_world_size=1, gpus_on_node=2)
    assert (placed.train_devices, placed.rollout_devices) == ((0,), (1,))
