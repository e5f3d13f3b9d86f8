"""Fixtures shared by the rollout tests (the session's vLLM engine itself is `tests/conftest.py:vllm_colocated`)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import LLMBuilt, restore_checkpoint_weights


@pytest.fixture
def vllm_rollout(vllm_colocated, tiny_model_path):
    """The session's vLLM engine holding the tiny model's checkpoint weights (a test before may have synced others)."""
    restore_checkpoint_weights(vllm_colocated, tiny_model_path)
    return vllm_colocated


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    """The tiny model in transformers, float32, eval mode: the reference the rollout log-probs are checked against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@pytest.fixture
def llm_calls(monkeypatch):
    """`vllm.LLM` replaced by a fake that records its keyword arguments, then raises `LLMBuilt` (nothing starts)."""
    import vllm

    calls = []

    def fake_llm(**kwargs):
        calls.append(kwargs)
        raise LLMBuilt

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    return calls


@pytest.fixture
def as_gpu(monkeypatch):
    """Build the engine arguments as on a GPU (no CPU-only adjustments), still without starting anything."""
    from ds_rlhf.rollout import vllm_handle

    monkeypatch.setattr(vllm_handle, "is_cpu_platform", lambda: False)
