"""The sync canary's default threshold follows the rollout weights' dtype and the trainer's device: strict for
float32 on CPU (exact kernels on both sides), looser for float32 on CUDA (TF32, vLLM's kernels) and for bf16/fp16."""

from __future__ import annotations

import torch

from ds_rlhf.rollout.canary import SyncCanary, default_threshold


class _Engine:
    def __init__(self, dtype):
        self.weight_dtype = dtype

    def logprobs_replicas_later(self, sequences):
        return None


def test_float32_on_cpu_is_strictest_and_bf16_loosest():
    cpu32, cuda32 = default_threshold(torch.float32, "cpu"), default_threshold(torch.float32, "cuda")
    assert cpu32 < cuda32 < default_threshold(torch.bfloat16, "cuda") == default_threshold(torch.float16, "cuda")
    assert default_threshold(None) == default_threshold(torch.bfloat16)  # unknown dtype: the loose default


def test_a_check_takes_the_trainers_device_and_an_explicit_threshold_wins():
    model = torch.nn.Linear(2, 2)  # on CPU
    check = SyncCanary([1, 2, 3]).start(model, _Engine(torch.float32), probe=([0.0, 0.0], 0.0))
    assert check.threshold == default_threshold(torch.float32, "cpu")
    check = SyncCanary([1, 2, 3], threshold=0.25).start(model, _Engine(torch.float32), probe=([0.0, 0.0], 0.0))
    assert check.threshold == 0.25
