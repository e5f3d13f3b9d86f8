"""The Hugging Face generate backend: same contract as vLLM, weight updates, the sync path with a DeepSpeed trainer,
and the factory's automatic fallback when vLLM is missing. Needs no vLLM."""

from __future__ import annotations

import logging

import pytest
import torch
from rollout_helpers import (
    PROBE,
    STALE_MIN,
    TOL,
    build_engine,
    check_generate_contract,
    reference_logprobs,
    response_logits,
    train,
)

from ds_rlhf.rollout import SamplingSpec, SyncCanary, SyncCanaryError, WeightSync, make_rollout_engine
from ds_rlhf.rollout.weights.canary import trainer_logprobs


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_path):
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", batch_size=4)
    yield engine
    engine.close()


def test_generate_contract(hf_rollout, tiny_tokenizer):
    check_generate_contract(hf_rollout, tiny_tokenizer.eos_token_id)


def test_logprobs_are_processed_and_batching_invariant(hf_rollout):
    """Log-probs of the distribution sampled from (temperature, top-k, top-p: vLLM's processed_logprobs)."""
    spec = SamplingSpec(n=3, max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=4)
    prompts = [[1, 5, 6, 7], [1, 9], [1, 2, 3, 4, 5, 6]]
    samples = hf_rollout.generate(prompts, spec)
    for s in samples:
        ref = reference_logprobs(response_logits(hf_rollout.model, s), s.response_ids, 0.8, 0.9, 50)
        assert max(abs(a - b) for a, b in zip(ref.tolist(), s.logprobs)) < TOL
    # per-request seeds: a sample does not depend on which other rows share its batch
    hf_rollout.batch_size = 1
    try:
        one_by_one = hf_rollout.generate(prompts, spec)
    finally:
        hf_rollout.batch_size = 4
    assert [s.response_ids for s in one_by_one] == [s.response_ids for s in samples]


def test_sync_from_deepspeed(hf_rollout, tiny_model_path, dist_single):
    from transformers import AutoModelForCausalLM

    hf_rollout.weights.load(AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).named_parameters())
    engine = build_engine(tiny_model_path, stage=0)
    canary = SyncCanary(PROBE)
    assert canary.measure(engine, hf_rollout)["max_abs_diff"] < TOL
    train(engine)
    with pytest.raises(SyncCanaryError):
        canary.check(engine, hf_rollout)
    assert canary.history[-1]["max_abs_diff"] > STALE_MIN
    info = WeightSync(engine, hf_rollout, bucket_bytes=1 << 16, canary=canary).sync()
    assert info["canary_max_abs_diff"] < TOL and info["bytes"] > 0
    assert hf_rollout.weights.dtype == torch.float32


def test_update_rejects_unknown_names(hf_rollout):
    with pytest.raises(KeyError, match="no parameter"):
        hf_rollout.weights.load([("model.nope.weight", torch.zeros(1))])


def test_auto_falls_back_to_hf_with_warning(tiny_model_path, monkeypatch, caplog):
    import ds_rlhf.rollout.vllm_adapter as adapter

    monkeypatch.setattr(adapter, "vllm_version", lambda: None)
    with caplog.at_level(logging.WARNING):
        engine = make_rollout_engine("auto", model_path=str(tiny_model_path), dtype="float32")
    assert engine.backend == "hf" and "falling back to the Hugging Face" in caplog.text
    engine.close()
    monkeypatch.setattr(adapter, "vllm_version", lambda: "0.99.0")
    with caplog.at_level(logging.WARNING):
        engine = make_rollout_engine("auto", model_path=str(tiny_model_path), dtype="float32")
    assert engine.backend == "hf" and "not a version ds_rlhf knows" in caplog.text
    engine.close()
    with pytest.raises(ValueError, match="only runs colocated"):
        make_rollout_engine("hf", "disaggregated", model_path=str(tiny_model_path))


def test_trainer_logprobs_match_hf_score(hf_rollout, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    hf_rollout.weights.load(model.named_parameters())
    assert max(abs(a - b) for a, b in zip(trainer_logprobs(model, PROBE), hf_rollout.logprobs([PROBE])[0])) < 1e-5
