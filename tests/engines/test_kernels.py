"""`model.kernels`: which body kernels a run gets, and the errors that name why liger's cannot run."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines import kernels


def test_none_is_hugging_face_layers_everywhere():
    assert kernels.resolve("none", "qwen2", "cuda") == "none"


def test_auto_is_none_on_cpu_and_without_liger(monkeypatch):
    assert kernels.resolve("auto", "qwen2", "cpu") == "none"

    def missing(_):
        raise ImportError("liger-kernel is not installed (pip install liger-kernel)")

    monkeypatch.setattr(kernels, "_liger_fn", missing)
    assert kernels.resolve("auto", "qwen2", "cuda") == "none"


def test_auto_picks_liger_on_cuda_for_a_known_model_type(monkeypatch):
    monkeypatch.setattr(kernels, "_liger_fn", lambda t: (lambda **kw: None) if t == "qwen2" else None)
    assert kernels.resolve("auto", "qwen2", "cuda") == "liger"
    assert kernels.resolve("auto", "mystery", "cuda") == "none"


@pytest.mark.parametrize("device, fn, message", [
    ("cpu", None, "need a CUDA device"),
    ("cuda", "missing", "not installed"),
    ("cuda", "unknown", "no kernels for model type 'mystery'"),
])
def test_liger_where_it_cannot_run_is_an_error_naming_why(monkeypatch, device, fn, message):
    if fn == "missing":
        def fake(_):
            raise ImportError("liger-kernel is not installed (pip install liger-kernel)")
    else:
        def fake(_):
            return None
    monkeypatch.setattr(kernels, "_liger_fn", fake)
    with pytest.raises(ValueError, match=message):
        kernels.resolve("liger", "mystery", device)


def test_apply_calls_liger_with_the_body_kernels_only(monkeypatch, tiny_model_path):
    """On a (pretended) CUDA machine the model goes to liger's patch function with RMSNorm / SwiGLU / rotary on and
    liger's loss heads off (RL's log-prob head is our own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    calls = []

    def patch(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
              model=None):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, flce=fused_linear_cross_entropy,
                          rms_norm=rms_norm, swiglu=swiglu, model=model))

    monkeypatch.setattr(kernels, "run_device_type", lambda: "cuda")
    monkeypatch.setattr(kernels, "_liger_fn", lambda t: patch if t == model.config.model_type else None)
    assert kernels.apply_kernels(model, "auto") == "liger"
    assert calls == [dict(rope=True, cross_entropy=False, flce=False, rms_norm=True, swiglu=True, model=model)]
    assert kernels.apply_kernels(model, "none") == "none" and len(calls) == 1


def test_the_run_device_is_deepspeeds_accelerator_not_whether_cuda_exists(monkeypatch):
    """DS_ACCELERATOR=cpu on a GPU host trains on CPU: auto must not pick liger's CUDA-only kernels there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from deepspeed.accelerator import get_accelerator

    assert kernels.run_device_type() == get_accelerator().device_name() == "cpu"  # this CPU-only CI machine


def test_the_config_key_takes_only_the_three_choices(tmp_path):
    assert parse_config(["--model.kernels", "none"]).model.kernels == "none"
    assert parse_config([]).model.kernels == "auto"
    with pytest.raises(ConfigError, match="kernels"):
        parse_config(["--model.kernels", "triton"])


def test_preflight_refuses_liger_where_it_cannot_run_before_any_model_loads(tiny_model_path):
    """On this CPU machine `--model.kernels liger` is one ConfigError from the run's preflight, naming the device."""
    from ds_rlhf.run.preflight import check_kernels

    check_kernels(parse_config(["--model.path", str(tiny_model_path)]))  # auto: nothing to check
    with pytest.raises(ConfigError, match="CUDA device"):
        check_kernels(parse_config(["--model.path", str(tiny_model_path), "--model.kernels", "liger"]))
