"""Fixtures of the policy-update tests on the tiny model: a plain module dressed as the slice of DeepSpeedEngine that
`policy_update` calls, one intra-op thread for the module, and the tiny actor in float32. Import the fixtures into a
test module to use them."""

from __future__ import annotations

import pytest
import torch


def as_engine(module, lr: float = 0.05):
    """The slice of DeepSpeedEngine that `policy_update` calls, on a plain module (SGD)."""
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=lr)
    module.backward = lambda loss, scale_wrt_gas=True: loss.backward()
    module.step = lambda: (opt.step(), opt.zero_grad())
    return module


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tensors here are tiny: one intra-op thread is as fast alone and far faster on a shared, busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.config.use_cache = False
    return model
