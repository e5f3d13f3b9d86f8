"""`rollout.dtype`: the rollout engines' precision apart from the trainer's `model.dtype` (auto: the trainer's). The
settings and their refusals, the precision the RL build hands the engine, the weight sync casting fp32 trainer
weights to the engine's dtype (a fake engine and the HF engine, which loads its own copy in that dtype), and the
engines' KV cache and weights planned in the engine's dtype. vLLM-CPU takes fp32 only, so a bf16 vLLM rollout runs on
GPUs only (bench/learn.py with `--cfg model.dtype=fp32 --cfg rollout.dtype=bf16`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import ConfigError, help_text, parse_config
from ds_rlhf.memory.engine_budget import choose_engine_budget
from ds_rlhf.memory.plan import plan_memory
from ds_rlhf.ops.memory import format_plan
from ds_rlhf.recipes import rl_build
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.rollout_precision import check_rollout_precision, mixed_precision_note
from ds_rlhf.rollout import WeightSync, make_rollout_engine
from ds_rlhf.rollout.base import InProcessWeights, RolloutEngine
from tests.memory import smol_shape
from tests.memory.smol_shape import H100, SMOL_WORK

smol = smol_shape.smol  # the module's fixture


# ---- settings ---------------------------------------------------------------------------------------------------
def test_auto_is_the_trainers_precision_and_a_setting_is_the_engines_own():
    assert parse_config([]).rollout.dtype == "auto"
    assert [parse_config([]).rollout.engine_precision(p) for p in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    for dtype in ("fp32", "bf16", "fp16"):
        cfg = parse_config(["--model.dtype", "fp32", "--rollout.dtype", dtype])
        assert cfg.rollout.engine_precision("fp32") == dtype and cfg.model.dtype == "fp32"
    assert parse_config(["--rollout.dtype", "bf16"]).rollout.vllm_options() == {}  # the engine's `dtype=`, apart
    assert "--rollout.dtype" in help_text()


@pytest.mark.parametrize("argv, message", [
    (["--rollout.dtype", "int8"], "rollout.dtype"),
    (["--rollout.dtype", "fp32", "--rollout.quantization", "fp8"],
     r"rollout.dtype=fp32 with rollout.quantization=fp8: vLLM's online FP8 quantizes bf16 or fp16 .*"
     r"--rollout.dtype bf16"),
])
def test_settings_the_engine_cannot_run_are_refused_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


def test_fp8_quantizes_from_a_bf16_or_fp16_engine():
    for dtype in ("bf16", "fp16"):
        cfg = parse_config(["--model.dtype", "fp32", "--rollout.dtype", dtype, "--rollout.quantization", "fp8"])
        assert cfg.rollout.vllm_options()["quantization"] == "fp8"


def _ctx(device: str, precision: str):
    return SimpleNamespace(dist=SimpleNamespace(device=torch.device(device)), precision=precision)


def test_the_run_refuses_an_engine_precision_vllm_cannot_run_before_any_model():
    pytest.importorskip("vllm")
    vllm = ["--rollout.backend", "vllm"]
    with pytest.raises(ConfigError, match=r"^rollout.dtype=bf16 with the vLLM rollout on CPU: .*--rollout.dtype fp32"):
        check_rollout_precision(parse_config([*vllm, "--rollout.dtype", "bf16"]), _ctx("cpu", "fp32"))
    # a bf16 trainer with fp32 engines runs on vLLM-CPU; the HF backend loads its own copy in any precision
    check_rollout_precision(parse_config([*vllm, "--model.dtype", "bf16", "--rollout.dtype", "fp32"]),
                            _ctx("cpu", "bf16"))
    check_rollout_precision(parse_config(["--rollout.backend", "hf", "--rollout.dtype", "bf16"]), _ctx("cpu", "fp32"))
    # FP8 from an fp32 trainer's auto engine precision: refused on the GPU, where a bf16 engine quantizes instead
    fp8 = [*vllm, "--model.dtype", "fp32", "--rollout.quantization", "fp8"]
    with pytest.raises(ConfigError, match=r"model.dtype=fp32 \(fp32, .*rollout.quantization=fp8.*--rollout.dtype bf16"):
        check_rollout_precision(parse_config(fp8), _ctx("cuda", "fp32"))
    check_rollout_precision(parse_config([*fp8, "--rollout.dtype", "bf16"]), _ctx("cuda", "fp32"))


# ---- the engine the RL build starts -----------------------------------------------------------------------------
class EngineBuilt(Exception):
    pass


@pytest.mark.parametrize("extra, want", [([], "fp32"), (["--rollout.dtype", "bf16"], "bf16")])
def test_the_rl_build_starts_the_engine_in_the_rollout_precision(extra, want, tiny_model_path, tmp_path,
                                                                 dist_single, monkeypatch, capsys):
    from ds_rlhf.data.synthetic import write_addition_datasets

    calls = []

    def fake_engine(*args, **kwargs):
        calls.append(kwargs)
        raise EngineBuilt

    monkeypatch.setattr(rl_build, "make_rollout_engine", fake_engine)
    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=16, n_sft=8, n_pref=8,
                                     max_operand=20)
    argv = ["--model.path", str(tiny_model_path), "--data.train", str(stores["prompts"]), "--run.output_dir",
            str(tmp_path / "run"), "--rollout.backend", "hf", "--reward.fn", "math_shaped", "--run.progress",
            "false", "--run.tensorboard", "false", *extra]
    with pytest.raises(EngineBuilt):
        RLTrainer(parse_config(argv))
    assert calls[-1]["dtype"] == want  # the trainer is fp32 on CPU either way
    out = capsys.readouterr().out
    assert ("precision fp32, rollout engines bf16 (rollout.dtype)" in out) == (want == "bf16")  # the run's first line
    assert ("[rl] model.dtype fp32 with bf16 rollout engines: " in out) == (want == "bf16")  # before the engine starts


# ---- the weight sync casts to the engine's dtype ----------------------------------------------------------------
class RecordingEngine(RolloutEngine):
    """An engine whose weights are `dtype`: each bucket's tensors recorded as they arrive."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.received: list[tuple[str, torch.Tensor]] = []
        self.weights = InProcessWeights(self.received.extend, dtype)

    def generate(self, prompts, spec):
        raise NotImplementedError

    def logprobs(self, sequences):
        raise NotImplementedError


def test_the_sync_casts_fp32_trainer_weights_to_the_engines_dtype():
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    for dtype in (torch.bfloat16, torch.float16):
        engine = RecordingEngine(dtype)
        WeightSync(trainer, engine, bucket_bytes=256).sync()
        got = dict(engine.received)
        assert set(got) == {n for n, _ in trainer.named_parameters()}
        for name, p in trainer.named_parameters():
            assert got[name].dtype == dtype and torch.equal(got[name], p.detach().to(dtype))


def test_the_hf_engine_loads_and_syncs_in_the_rollout_precision(tiny_model_path):
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1e-2 * torch.randn_like(p))
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="bf16", batch_size=4)
    try:
        assert engine.weights.dtype == torch.bfloat16
        WeightSync(trainer, engine).sync()
        own = dict(engine.model.named_parameters())
        for name, p in trainer.named_parameters():
            assert own[name].dtype == torch.bfloat16 and torch.equal(own[name], p.detach().to(torch.bfloat16))
    finally:
        engine.close()


# ---- memory: the engines' KV cache and weights in their own dtype -----------------------------------------------
def _cfg(model: str, *args: str):
    return parse_config(["--model.path", model, "--rollout.backend", "vllm", "--rl.algo", "grpo", "--rl.kl_coef", "0",
                         *SMOL_WORK, *args])


def test_the_engine_budget_sizes_the_kv_cache_in_the_engines_dtype(smol):
    fp32_trainer_bf16_engines = choose_engine_budget(_cfg(smol, "--model.dtype", "fp32", "--rollout.dtype", "bf16"),
                                                     H100)
    bf16 = choose_engine_budget(_cfg(smol, "--model.dtype", "bf16"), H100)
    fp32 = choose_engine_budget(_cfg(smol, "--model.dtype", "bf16", "--rollout.dtype", "fp32"), H100)
    assert fp32_trainer_bf16_engines.kv == bf16.kv and fp32_trainer_bf16_engines.engine_bytes == bf16.engine_bytes
    # fp32 engines: twice the KV bytes for the same work (each rounded up to whole MiB) and twice the weights
    assert abs(fp32.kv.bytes - 2 * bf16.kv.bytes) <= 2 ** 20 and fp32.kv.bytes > 1.9 * bf16.kv.bytes
    plans = {d: plan_memory(_cfg(smol, "--model.dtype", "fp32", "--rollout.dtype", d), device="cuda", capacity=H100)
             for d in ("bf16", "fp32")}
    rows = {d: next(r for r in p.roles if r.role == "vllm") for d, p in plans.items()}
    assert rows["fp32"].params == 2 * rows["bf16"].params and "bf16 KV" in rows["bf16"].detail
    actors = {d: next(r for r in p.roles if r.role == "actor") for d, p in plans.items()}
    assert actors["bf16"] == actors["fp32"]  # the trainer's rows follow model.dtype only
    assert "engines in bf16 (rollout.dtype)" in format_plan(plans["bf16"])  # `ds-rlhf memory` says so
    assert "rollout.dtype" not in format_plan(plans["fp32"])  # fp32 engines beside an fp32 trainer: nothing to say


def test_a_float32_trainer_with_narrower_engines_is_named_in_one_line():
    note = mixed_precision_note(parse_config(["--rollout.dtype", "bf16"]), _ctx("cuda", "fp32"))
    assert note.startswith("[rl] model.dtype fp32 with bf16 rollout engines: ") and "\n" not in note
    assert "rl.mismatch tis weights the samples" in note and "--model.dtype bf16" in note
    off = mixed_precision_note(parse_config(["--rollout.dtype", "fp16", "--rl.mismatch", "off"]), _ctx("cuda", "fp32"))
    assert "with fp16 rollout engines" in off and "(rl.mismatch off) is off: nothing weights it" in off
    for argv, precision in (([], "fp32"), ([], "bf16"), (["--rollout.dtype", "fp32"], "bf16")):
        assert mixed_precision_note(parse_config(argv), _ctx("cuda", precision)) is None  # one precision on both
