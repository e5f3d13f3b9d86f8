"""Fixtures shared by the rollout tests (the session's vLLM engine itself is `tests/conftest.py:vllm_colocated`)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import restore_checkpoint_weights


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
