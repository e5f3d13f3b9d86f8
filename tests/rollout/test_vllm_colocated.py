"""vLLM (CPU, float32) colocated in the test process: the generate contract, and DeepSpeed -> vLLM weight sync at
ZeRO-0 and ZeRO-3 (world size 1) proven by log-probs, plus the canary firing when a sync is skipped or empty.

All tests share the session's single vLLM engine (`vllm_colocated`); each loads the weights it needs first.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    PROBE,
    SMALL_BUCKET,
    STALE_MIN,
    TOL,
    build_engine,
    check_generate_contract,
    reference_logprobs,
    response_logits,
    skipped_sync_fires,
    sync_roundtrip,
    train,
)

from ds_rlhf.rollout import SamplingSpec, SyncCanary, SyncCanaryError, WeightSync
from ds_rlhf.rollout.weights.canary import trainer_logprobs


def test_generate_contract(vllm_rollout, tiny_tokenizer):
    check_generate_contract(vllm_rollout, tiny_tokenizer.eos_token_id)


def test_rollout_logprobs_and_score_match_hf(vllm_rollout, hf_model):
    """Sampled-token log-probs are those of the distribution sampled from (temperature and top-k applied: vLLM's
    processed_logprobs, test_processed_logprobs.py has more cases); `score` is the raw model's."""
    spec = SamplingSpec(n=2, max_new_tokens=12, temperature=0.7, top_k=20, seed=5, ignore_eos=True)
    for s in vllm_rollout.generate([[1, 5, 6, 7], [1, 9]], spec):
        ref = reference_logprobs(response_logits(hf_model, s), s.response_ids, temperature=0.7, top_k=20)
        assert max(abs(a - b) for a, b in zip(ref.tolist(), s.logprobs)) < TOL
    got = vllm_rollout.logprobs([PROBE, PROBE[:10]])
    assert len(got[0]) == len(PROBE) - 1 and len(got[1]) == 9
    assert max(abs(a - b) for a, b in zip(trainer_logprobs(hf_model, PROBE), got[0])) < TOL


@pytest.mark.parametrize("stage", [0, 3])
def test_sync_after_optimizer_steps(vllm_rollout, tiny_model_path, dist_single, stage):
    r = sync_roundtrip(vllm_rollout, tiny_model_path, stage)
    assert r["initial"] < TOL, "engine and rollout start from the same checkpoint"
    assert r["stale"] > STALE_MIN, "after training, before the sync, the rollout must NOT match"
    assert r["after"] < TOL and r["gen_diff"] < TOL
    n_bytes = sum(getattr(p, "ds_numel", p.numel()) * 4 for p in r["engine"].module.parameters())  # tied: once
    assert r["bytes"] == n_bytes and r["buckets"] > 5 and r["gbps"] > 0
    if stage == 3:
        largest = max(p.ds_numel * 4 for p in r["engine"].module.parameters())
        assert r["max_gathered_bytes"] <= max(SMALL_BUCKET, largest)


def test_canary_fires_when_sync_skipped(vllm_rollout, tiny_model_path, dist_single):
    msg = skipped_sync_fires(vllm_rollout, tiny_model_path, stage=0)
    assert "not serving the trained weights" in msg and "threshold" in msg


def test_canary_fires_when_sync_sends_nothing(vllm_rollout, tiny_model_path, dist_single):
    """A sync that silently loads nothing (here: every name mapped away) is caught by the sync itself."""
    engine = build_engine(tiny_model_path, stage=0)
    train(engine)
    sync = WeightSync(engine, vllm_rollout, canary=SyncCanary(PROBE), name_map=lambda name: None)
    with pytest.raises(SyncCanaryError, match="not serving the trained weights"):
        sync.sync()


def test_sleep_wake_order(vllm_rollout, tiny_model_path, dist_single):
    """Sleep state is tracked on CPU too (vLLM's CPU worker has no sleep mode): generate refuses while asleep,
    and a sync wakes the weights first and the KV cache last."""
    vllm_rollout.sleep()
    assert vllm_rollout.sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        vllm_rollout.generate([[1, 2]], SamplingSpec(max_new_tokens=2))
    engine = build_engine(tiny_model_path, stage=0)
    info = WeightSync(engine, vllm_rollout, canary=SyncCanary(PROBE)).sync()
    assert not vllm_rollout.sleeping and info["canary_max_abs_diff"] < TOL
    stats = vllm_rollout.stats()
    assert "wake_weights_seconds" in stats and "wake_kv_cache_seconds" in stats


def test_colocated_handover_is_by_reference(vllm_rollout, hf_model, monkeypatch):
    """The worker receives the trainer's own tensors (same storage): no serialisation, no copy via the host."""
    from ds_rlhf.rollout.vllm_worker import WeightSyncWorkerExtension

    seen = []
    original = WeightSyncWorkerExtension.ds_rlhf_load_weights

    def spy(self, named_tensors):
        named_tensors = list(named_tensors)
        seen.extend(t.data_ptr() for _, t in named_tensors)
        return original(self, named_tensors)

    monkeypatch.setattr(WeightSyncWorkerExtension, "ds_rlhf_load_weights", spy)
    params = list(hf_model.named_parameters())
    vllm_rollout.weights.load(params)
    assert seen == [p.data_ptr() for _, p in params]


def test_batch_seeding_reseeds_once_and_sends_no_request_seeds(vllm_rollout, monkeypatch):
    """seeding="batch": one `ds_rlhf_reseed` per call and no per-request seeds (vLLM then samples the whole batch
    in one kernel instead of looping over seeded requests each decode step); "request" seeds every request."""
    from ds_rlhf.rollout import SamplingSpec

    llm = vllm_rollout.handle.llm
    calls, seeds = [], []
    real_rpc, real_generate = llm.collective_rpc, llm.generate
    monkeypatch.setattr(llm, "collective_rpc", lambda m, *a, **k: (calls.append((m, k.get("args"))),
                                                                   real_rpc(m, *a, **k))[1])
    monkeypatch.setattr(llm, "generate", lambda p, params, **k: (seeds.extend(x.seed for x in params),
                                                                 real_generate(p, params, **k))[1])
    vllm_rollout.generate([[1, 5, 6], [1, 7]], SamplingSpec(n=2, max_new_tokens=3, seed=4, seeding="batch"))
    assert [c for c in calls if c[0] == "ds_rlhf_reseed"] == [("ds_rlhf_reseed", (4,))] and seeds == [None, None]
    calls.clear(), seeds.clear()
    vllm_rollout.generate([[1, 5, 6], [1, 7]], SamplingSpec(n=2, max_new_tokens=3, seed=4))
    assert not [c for c in calls if c[0] == "ds_rlhf_reseed"] and seeds == [4, 6]


def test_batch_seeding_leaves_the_trainers_rng_alone(vllm_rollout):
    """The in-process engine's workers share this process's generators: a batch-seeded call reseeds them for its
    own sampling and puts the trainer's state back, so the trainer's random stream is the same as without it."""
    from ds_rlhf.rollout import SamplingSpec

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    vllm_rollout.generate([[1, 5, 6]], SamplingSpec(n=2, max_new_tokens=3, seed=9, seeding="batch"))
    assert torch.equal(torch.rand(4), expected)
