"""FP8 rollouts (`rollout.quantization fp8`, docs/FP8_ROLLOUTS.md) on CPU, without starting vLLM: the settings and
their refusals, the engine arguments at the adapter boundary (vLLM's online FP8 methods, on every placement), the
reload that every sync of a quantized engine runs inside (opened before its first bucket, closed after its last, in
the colocated engine and in a server), the worker's calls into vLLM's layerwise reload, and the line a run prints
about the mismatch correction. The GPU test (tests/gpu/test_fp8_rollout.py) starts vLLM with FP8 weights."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import LLMBuilt

from ds_rlhf.config import help_text, parse_config
from ds_rlhf.config_rules import fp8_mismatch_note
from ds_rlhf.errors import ConfigError
from ds_rlhf.rollout import make_rollout_engine
from ds_rlhf.rollout.base import Pending, TensorMeta
from ds_rlhf.rollout.server.server import ServerSession
from ds_rlhf.rollout.vllm_adapter import engine_quantization_kwargs, quantization_methods, vllm_version
from ds_rlhf.rollout.vllm_engine import VLLMWeights
from ds_rlhf.rollout.vllm_handle import VLLMHandle
from ds_rlhf.rollout.vllm_mapping import quantization_kwargs
from ds_rlhf.rollout.vllm_worker import WeightSyncWorkerExtension
from ds_rlhf.rollout.weights.group import plan_to_wire

FP8 = ["--rollout.quantization", "fp8"]


# ---- settings ---------------------------------------------------------------------------------------------------
def test_fp8_is_off_by_default_and_travels_as_engine_options():
    assert parse_config([]).rollout.vllm_options() == {}
    assert parse_config(FP8).rollout.vllm_options() == {"quantization": "fp8", "fp8_scales": "tensor"}
    assert parse_config([*FP8, "--rollout.fp8_scales", "block"]).rollout.vllm_options() == {
        "quantization": "fp8", "fp8_scales": "block"}


@pytest.mark.parametrize("argv, message", [
    ([*FP8, "--rollout.backend", "hf"], "rollout.backend=hf generates with the trainer's own model"),
    ([*FP8, "--model.lora_rank", "8", "--rollout.lora_sync", "adapter", "--rollout.sleep_level", "1"],
     "use --rollout.lora_sync merged with FP8 rollouts"),
    (["--rollout.fp8_scales", "block"], "add --rollout.quantization fp8"),
    (["--rollout.quantization", "int4"], "rollout.quantization"),
])
def test_settings_fp8_cannot_run_with_are_refused_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_help_lists_the_fp8_settings():
    text = help_text()
    assert "--rollout.quantization" in text and "--rollout.fp8_scales" in text


def test_the_mismatch_correction_stays_on_with_fp8_and_one_line_says_so():
    assert fp8_mismatch_note(parse_config([])) is None
    cfg = parse_config(FP8)
    assert cfg.rl.mismatch == "tis"  # on by default
    assert fp8_mismatch_note(cfg).startswith("[rl] rollout.quantization=fp8: the mismatch correction "
                                             "rl.mismatch=tis")
    assert fp8_mismatch_note(parse_config([*FP8, "--rl.mismatch", "mis"])).count("rl.mismatch=mis") == 1
    off = parse_config([*FP8, "--rl.mismatch", "off"])
    assert off.rl.mismatch == "off"  # a setting the user gave is kept, and the line says what it means
    assert "rl.mismatch=off (as set)" in fp8_mismatch_note(off) and "\n" not in fp8_mismatch_note(off)


# ---- engine arguments (the adapter boundary) --------------------------------------------------------------------
def test_fp8_maps_to_vllms_online_fp8_methods():
    methods = {"fp8", "fp8_per_tensor", "fp8_per_block"}
    assert quantization_kwargs("none", cpu=True, version="x", methods=()) == {}
    assert quantization_kwargs("fp8", "tensor", cpu=False, version="x", methods=methods) == {
        "quantization": "fp8_per_tensor"}
    assert quantization_kwargs("fp8", "block", cpu=False, version="x", methods=methods) == {
        "quantization": "fp8_per_block"}
    with pytest.raises(ConfigError, match="runs on the CPU"):
        quantization_kwargs("fp8", "tensor", cpu=True, version="0.32.0", methods=methods)
    with pytest.raises(ConfigError, match="vLLM 0.20.0 has no 'fp8_per_block' quantization method"):
        quantization_kwargs("fp8", "block", cpu=False, version="0.20.0", methods={"fp8"})


def test_the_installed_vllm_has_both_online_fp8_methods():
    assert {"fp8_per_tensor", "fp8_per_block"} <= quantization_methods()
    assert engine_quantization_kwargs("fp8", "block", cpu=False, version=vllm_version()) == {
        "quantization": "fp8_per_block"}


def test_colocated_engine_starts_vllm_with_fp8(tiny_model_path, llm_calls, as_gpu):
    with pytest.raises(LLMBuilt):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), max_model_len=256,
                            **parse_config(FP8).rollout.vllm_options())
    (kw,) = llm_calls
    assert kw["quantization"] == "fp8_per_tensor" and "fp8_scales" not in kw


def test_default_engine_has_no_quantization(tiny_model_path, llm_calls, as_gpu):
    with pytest.raises(LLMBuilt):
        make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), max_model_len=256,
                            **parse_config([]).rollout.vllm_options())
    assert "quantization" not in llm_calls[0]


def test_a_server_builds_its_engine_with_fp8(tiny_model_path, llm_calls, as_gpu):
    """A sidecar / disaggregated server gets the engine keywords in 'start' and builds the same LLM."""
    kwargs = dict(max_model_len=256, **parse_config([*FP8, "--rollout.fp8_scales", "block"]).rollout.vllm_options())
    with pytest.raises(LLMBuilt):
        ServerSession().handle("start", (str(tiny_model_path), kwargs))
    assert llm_calls[0]["quantization"] == "fp8_per_block"


def test_vllm_cpu_is_refused_before_vllm_starts(tiny_model_path, llm_calls):
    with pytest.raises(ConfigError, match="needs vLLM on a CUDA GPU"):
        VLLMHandle(str(tiny_model_path), max_model_len=256, quantization="fp8")
    assert llm_calls == []


def test_hf_backend_refuses_fp8(tiny_model_path):
    with pytest.raises(ConfigError, match="the rollout backend is HF generate"):
        make_rollout_engine("hf", model_path=str(tiny_model_path), quantization="fp8", fp8_scales="tensor")


# ---- one reload per sync ----------------------------------------------------------------------------------------
class FakeLLM:
    def __init__(self) -> None:
        self.rpcs: list[str] = []
        self.loaded: list[torch.Tensor] = []

    def collective_rpc(self, method, args=()):
        self.rpcs.append(method if method != "ds_rlhf_load_weights" else f"load {[n for n, _ in args[0]]}")
        if method == "ds_rlhf_load_weights":
            self.loaded += [t for _, t in args[0]]

    def reset_prefix_cache(self) -> None:
        self.rpcs.append("reset_prefix_cache")


def _handle(quantized: bool) -> VLLMHandle:
    handle = object.__new__(VLLMHandle)  # the running LLM is a fake: only the calls it gets are recorded
    handle.llm, handle.in_process, handle.quantized, handle._reloading = FakeLLM(), True, quantized, False
    return handle


class FakeEngine:
    def __init__(self, handle) -> None:
        self.handle, self.lora = handle, None

    def require_weights(self, what) -> None:
        pass


def _buckets():
    return [[("a.weight", torch.ones(2))], [("b.weight", torch.ones(2)), ("c.weight", torch.ones(2))]]


@pytest.mark.parametrize("quantized", [True, False])
def test_a_colocated_sync_loads_every_bucket_inside_one_reload(quantized):
    handle = _handle(quantized)
    handle.dtype = torch.float32
    weights = VLLMWeights(FakeEngine(handle))
    assert isinstance(weights.send(_buckets()), Pending)
    loads = ["load ['a.weight']", "load ['b.weight', 'c.weight']", "reset_prefix_cache"]
    expected = ["ds_rlhf_begin_reload", *loads, "ds_rlhf_end_reload"] if quantized else loads
    assert handle.llm.rpcs == expected
    weights.send(_buckets())  # the next sync opens its own reload
    assert handle.llm.rpcs == expected * 2


def test_a_failed_load_still_closes_the_reload():
    handle = _handle(True)
    handle.dtype = torch.float32
    weights = VLLMWeights(FakeEngine(handle))

    def broken(_):
        raise RuntimeError("unknown weight name")

    weights.load_bucket = broken
    with pytest.raises(RuntimeError, match="unknown weight name"):
        weights.send(_buckets())
    assert handle.llm.rpcs == ["ds_rlhf_begin_reload", "ds_rlhf_end_reload"] and not handle._reloading


def test_a_servers_ipc_sync_is_one_reload_from_its_first_bucket_to_update_done():
    handle = _handle(True)
    session = ServerSession()
    session.engine = FakeEngine(handle)
    session.engine.weights = type("W", (), {"record": lambda *a: None})()
    session.ipc_buffer = torch.zeros(64, dtype=torch.uint8)
    for i, bucket in enumerate(_buckets()):
        session.ipc_buffer.view(torch.float32)[:4] = float(i + 1)  # the trainer fills the shared buffer
        session.update_ipc(plan_to_wire([[TensorMeta(n, tuple(t.shape), t.dtype) for n, t in bucket]]))
    session.update_done()
    # the reload held copies: the first bucket's tensor kept its values when the buffer was refilled
    assert [t.tolist() for t in handle.llm.loaded] == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]
    assert handle.llm.rpcs == ["ds_rlhf_begin_reload", "load ['a.weight']", "load ['b.weight', 'c.weight']",
                               "ds_rlhf_end_reload", "reset_prefix_cache"]


def test_the_worker_runs_vllms_layerwise_reload_on_its_model(monkeypatch):
    from vllm.model_executor.model_loader import reload

    calls = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: calls.append(("init", model)))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: calls.append(("final", model, cfg)))
    worker = object.__new__(WeightSyncWorkerExtension)
    model = torch.nn.Linear(2, 2)
    worker.model_runner = type("Runner", (), {"get_model": lambda self: model})()
    worker.model_config = "model config"
    worker.ds_rlhf_begin_reload()
    worker.ds_rlhf_end_reload()
    assert calls == [("init", model), ("final", model, "model config")]


# ---- an RL run ----------------------------------------------------------------------------------------------------
def _rl_argv(tiny_model_path, tmp_path, *extra):
    from ds_rlhf.data.synthetic import write_addition_datasets

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=16, n_sft=8, n_pref=8,
                                     max_operand=20)
    return ["--model.path", str(tiny_model_path), "--data.train", str(stores["prompts"]), "--run.output_dir",
            str(tmp_path / "run"), "--rollout.backend", "vllm", "--reward.fn", "math_shaped", "--run.progress",
            "false", "--run.tensorboard", "false", *FP8, *extra]


def test_an_rl_run_starts_vllm_with_fp8_and_says_the_correction_is_on(tiny_model_path, llm_calls, as_gpu, tmp_path,
                                                                       dist_single, capsys):
    from ds_rlhf.recipes.rl import RLTrainer

    with pytest.raises(LLMBuilt):
        RLTrainer(parse_config(_rl_argv(tiny_model_path, tmp_path, "--rollout.fp8_scales", "block")))
    assert llm_calls[-1]["quantization"] == "fp8_per_block"
    lines = [line for line in capsys.readouterr().out.splitlines() if "rollout.quantization=fp8" in line]
    assert len(lines) == 1 and "rl.mismatch=tis" in lines[0]


def test_an_rl_run_on_vllm_cpu_is_refused_before_vllm_starts(tiny_model_path, llm_calls, tmp_path, dist_single):
    from ds_rlhf.recipes.rl import RLTrainer

    with pytest.raises(ConfigError, match="needs vLLM on a CUDA GPU"):
        RLTrainer(parse_config(_rl_argv(tiny_model_path, tmp_path)))
    assert llm_calls == []
