"""The sync canary's default threshold follows the rollout weights' dtype and the trainer's device: strict for
float32 on CPU (exact kernels on both sides), looser for float32 on CUDA (TF32, vLLM's kernels) and for bf16/fp16."""

from __future__ import annotations

import types

import pytest
import torch

from ds_rlhf.rollout.base import Pending
from ds_rlhf.rollout.weights.canary import SyncCanary, SyncCanaryError, default_threshold


class _Engine:
    def __init__(self, dtype):
        self.weights = types.SimpleNamespace(dtype=dtype)

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


class _Scored(_Engine):
    """An engine whose probe log-probs are the trainer's plus `offsets`."""

    def __init__(self, dtype, ref, offsets):
        super().__init__(dtype)
        self.got = [r + o for r, o in zip(ref, offsets)]

    def logprobs_replicas_later(self, sequences):
        return Pending.done([[self.got]])


def _judge(dtype, offsets):
    ref = [-1.0] * len(offsets)
    check = SyncCanary(list(range(len(offsets) + 1))).start(torch.nn.Linear(2, 2), _Scored(dtype, ref, offsets),
                                                           probe=(ref, 0.0))
    return check.finish()


def test_bf16_judges_the_mean_so_one_noisy_token_passes_and_a_shifted_probe_fails():
    one_noisy_token = [0.1] * 56 + [1.6]  # as on a trained SmolLM2 in bf16 after a good sync: max 1.57, mean 0.15
    assert _judge(torch.bfloat16, one_noisy_token) == pytest.approx((0.1 * 56 + 1.6) / 57)
    with pytest.raises(SyncCanaryError, match="mean abs log-prob difference 0.8 > threshold 0.5"):
        _judge(torch.bfloat16, [0.8] * 57)  # every token moved: weights not applied / mis-mapped
    with pytest.raises(SyncCanaryError, match="max abs log-prob difference"):
        _judge(torch.float32, [0.0] * 56 + [0.01])  # float32 stays sharp: one token off fails
