"""`rollout.weight_transport` (own | vllm): the setting's validation, the vLLM engine keyword it adds (only when
chosen, and through the sidecar server's 'start'), the refusals outside the sidecar, the missing-package message of
vLLM's IPC engine import, and the bucket stream handed to vLLM's producer. The transfer itself needs CUDA:
`tests/gpu/test_vllm_weight_transport.py`. `vllm.LLM` is replaced by a recorder that stops before an engine starts."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from rollout_helpers import LLMBuilt

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout import make_rollout_engine
from ds_rlhf.rollout.base import RolloutError, TensorMeta
from ds_rlhf.rollout.server import client as remote
from ds_rlhf.rollout.server import server as remote_server
from ds_rlhf.rollout.server.client import RemoteVLLMEngine
from ds_rlhf.rollout.vllm_adapter import engine_arg_names, ipc_engine_module
from ds_rlhf.rollout.vllm_mapping import named_tensors_from_buckets, transfer_buffer_bytes, weight_transfer_kwargs
from ds_rlhf.run.placement import resolve_placement

pytest.importorskip("vllm")

SIDECAR_VLLM = ["--rollout.placement", "sidecar", "--rollout.weight_transport", "vllm"]


# ---- the setting ----------------------------------------------------------------------------------------------------
def test_default_is_own_and_vllm_is_accepted_on_the_sidecar():
    assert parse_config([]).rollout.weight_transport == "own"
    assert parse_config(SIDECAR_VLLM).rollout.weight_transport == "vllm"


@pytest.mark.parametrize("argv, message", [
    (["--rollout.weight_transport", "vllm"], "rollout.weight_transport=vllm .* rollout.placement=colocated"),
    (["--rollout.weight_transport", "vllm", "--rollout.placement", "disaggregated"],
     "rollout.placement=disaggregated"),
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


# ---- the engine keyword ---------------------------------------------------------------------------------------------
def test_weight_transfer_config_only_when_vllm_is_chosen():
    names = engine_arg_names()
    assert "weight_transfer_config" in names  # the installed vLLM has the engine argument
    assert weight_transfer_kwargs("own", version="x", arg_names=names) == {}
    assert weight_transfer_kwargs("vllm", version="x", arg_names=names) == {
        "weight_transfer_config": {"backend": "ipc"}}
    with pytest.raises(RolloutError, match=r"vLLM 0\.25\.0 has no weight_transfer_config .*weight_transport own"):
        weight_transfer_kwargs("vllm", version="0.25.0", arg_names=names - {"weight_transfer_config"})


def _sidecar_start_kwargs(monkeypatch, tiny_model_path, **kw) -> dict:
    """The keywords a sidecar client sends in 'start' (no server spawned)."""

    sent = {}

    def fake_start(self, process, model_path, startup_timeout_s, engine_kwargs):
        sent.update(model_path=model_path, kwargs=engine_kwargs)
        return {"error": "stopped before starting a server"}

    monkeypatch.setattr(remote, "ServerProcess", lambda **kw: None)  # nothing is spawned
    monkeypatch.setattr(RemoteVLLMEngine, "_start", fake_start)
    with pytest.raises(RolloutError, match="stopped before"):
        make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), max_model_len=256,
                            weight_backend="ipc", **kw)
    return sent


@pytest.mark.parametrize("transport", ["own", "vllm"])
def test_sidecar_server_builds_llm_with_weight_transfer_config_only_for_vllm(transport, tiny_model_path, llm_calls,
                                                                             as_gpu, monkeypatch):

    extra = {} if transport == "own" else {"weight_transport": "vllm"}
    sent = _sidecar_start_kwargs(monkeypatch, tiny_model_path, **extra)
    with pytest.raises(LLMBuilt):
        remote_server._handle(None, "start", (sent["model_path"], sent["kwargs"]))
    (kw,) = llm_calls
    if transport == "own":
        assert "weight_transfer_config" not in kw
    else:
        assert kw["weight_transfer_config"] == {"backend": "ipc"}
    assert "weight_transport" not in kw  # our setting, not a vLLM argument


def test_vllm_transport_is_refused_by_engines_without_cuda_ipc(tiny_model_path, monkeypatch):

    spawned = []
    monkeypatch.setattr(remote, "ServerProcess", lambda **kw: spawned.append(kw))
    with pytest.raises(RolloutError, match="weight_transport=vllm .* sidecar .*over gloo here.*weight_transport own"):
        RemoteVLLMEngine(str(tiny_model_path), weight_backend="gloo", weight_transport="vllm")
    assert spawned == []  # refused before a server was started
    with pytest.raises(ValueError, match="weight_transport='vllm' needs placement='sidecar'"):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), weight_transport="vllm")


# ---- vLLM's IPC engine import ---------------------------------------------------------------------------------------
class _NoRay(importlib.abc.MetaPathFinder):
    """Imports of vLLM's ipc_engine fail as they do where `ray` is not installed (vLLM 0.26 imports it at top)."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm.distributed.weight_transfer.ipc_engine":
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return None


def test_missing_package_of_vllms_ipc_engine_is_named_in_one_line(monkeypatch):
    assert ipc_engine_module().__name__ == "vllm.distributed.weight_transfer.ipc_engine"
    monkeypatch.delitem(sys.modules, "vllm.distributed.weight_transfer.ipc_engine")
    monkeypatch.delattr(sys.modules["vllm.distributed.weight_transfer"], "ipc_engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoRay(), *sys.meta_path])
    with pytest.raises(RolloutError, match="needs the Python package 'ray', .*--rollout.weight_transport own") as info:
        ipc_engine_module()
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


# ---- the GPU bench's flag -------------------------------------------------------------------------------------------
def test_bench_passes_the_weight_transport_to_the_run(tmp_path, monkeypatch):

    path = Path(__file__).resolve().parents[2] / "bench" / "rl_step_gpu.py"
    spec = importlib.util.spec_from_file_location("rl_step_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run_argv(*flags):
        monkeypatch.setattr("sys.argv", ["rl_step_gpu.py", "--workdir", str(tmp_path), *flags])
        captured = {}
        monkeypatch.setattr(bench, "run_one", lambda args, *a, **k: captured.update(args=args))
        monkeypatch.setattr(bench, "build_model", lambda *a: tmp_path)
        monkeypatch.setattr(bench, "build_prompts", lambda *a: tmp_path)
        bench.main()
        return bench.config_argv(captured["args"], tmp_path, tmp_path, "sidecar", tmp_path / "run", [])[0]

    assert parse_config(run_argv()).rollout.weight_transport == "own"
    assert parse_config(run_argv("--weight-transport", "vllm")).rollout.weight_transport == "vllm"
