"""A float32 trainer with a bf16 engine: the engine holds each weight rounded to bf16, so Adam steps smaller than
half a bf16 step move the trainer's float32 forward but not the engine's. The canary's trainer side runs under
autocast to the engine's dtype and agrees with a bf16 engine that holds exactly the rounded weights; a sync that was
not applied still fails it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_rlhf.rollout.base import Pending
from ds_rlhf.rollout.weights.canary import SyncCanary, SyncCanaryError, reference_autocast, trainer_logprobs

PROBE = list(range(3, 60))


class _Bf16Engine:
    """A rollout engine holding `model`'s weights rounded to bf16 and scoring the probe with them (as vLLM does)."""

    def __init__(self, model):
        self.held = copy.deepcopy(model).to(torch.bfloat16)
        self.weights = type("Weights", (), {"dtype": torch.bfloat16})()

    def logprobs_replicas_later(self, sequences):
        return Pending.done([[trainer_logprobs(self.held, sequences[0])]])


class _Plain(_Bf16Engine):
    """The same engine reporting float32 weights, so the canary compares against the trainer's plain forward."""

    def __init__(self, engine):
        self.held = engine.held
        self.weights = type("Weights", (), {"dtype": torch.float32})()


def _drift(model, ulps: float) -> None:
    """Move every non-zero weight by `ulps` bf16 steps along the probe's log-likelihood gradient: the same-sign
    direction Adam's early steps take."""
    x = torch.tensor([PROBE])
    logits = model(input_ids=x).logits[0, :-1]
    torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            exponent = torch.frexp(p.abs().clamp_min(1e-30))[1]
            p.add_(torch.where(p != 0, ulps * torch.ldexp(torch.ones_like(p), exponent - 8) * p.grad.sign(), 0.0))
    model.zero_grad()


@pytest.fixture
def fp32_trainer(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).float()


def test_autocast_only_for_a_float32_trainer_with_a_narrower_engine():
    assert reference_autocast(torch.float32, torch.bfloat16) and reference_autocast(torch.float32, torch.float16)
    assert not reference_autocast(torch.float32, torch.float32)
    assert not reference_autocast(torch.bfloat16, torch.bfloat16)
    assert not reference_autocast(torch.float32, None)  # no engine on this rank


def test_sub_step_drift_passes_when_the_engine_holds_the_rounded_weights(fp32_trainer):
    rounded = {n: p.to(torch.bfloat16) for n, p in fp32_trainer.named_parameters()}
    _drift(fp32_trainer, 0.24)  # under half a bf16 step everywhere: the rounding does not move
    assert all(torch.equal(p.to(torch.bfloat16), rounded[n]) for n, p in fp32_trainer.named_parameters())
    engine = _Bf16Engine(fp32_trainer)
    plain = SyncCanary(PROBE, threshold=10.0).start(fp32_trainer, _Plain(engine)).measure()["mean_abs_diff"]
    judged = SyncCanary(PROBE, threshold=0.01).start(fp32_trainer, engine).finish()
    assert judged < plain / 3  # the float32 forward moved away from the engine's; the autocast one did not


def test_a_sync_not_applied_still_fails(fp32_trainer):
    engine = _Bf16Engine(fp32_trainer)  # holds the weights before the step
    _drift(fp32_trainer, 4.0)
    with pytest.raises(SyncCanaryError, match="mean abs log-prob difference"):
        SyncCanary(PROBE, threshold=0.01).start(fp32_trainer, engine).finish()

