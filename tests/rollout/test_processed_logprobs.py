"""Rollout log-probs are those of the distribution the engine sampled from (vLLM `processed_logprobs`; the HF
backend the same): logits / temperature, then top-k / top-p, renormalised. Checked on the tiny model (float32, CPU)
against the untruncated temperature-scaled log-probs (`policy_forward.sequence_logprobs` without top_p / top_k;
the trainer's truncated ones: `test_truncated_trainer_logprobs.py`) and against an exact
reference computed from the logits with vLLM's truncation rule; the canary (raw prompt log-probs) is unaffected,
and an RL step with temperature 0.7 and the mismatch correction runs and agrees with the rollout.

vLLM tests share the session's engine (`vllm_colocated`); the HF engine is built once for this module.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_helpers import PROBE, TOL, reference_logprobs, response_logits, restore_checkpoint_weights

from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.rollout import SamplingSpec, SyncCanary, make_rollout_engine

PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12]]
# (temperature, top_p, top_k). The tiny model is near-uniform over its 512 tokens, so top_p 0.9 and top_k 20 cut
# off a large share of the mass: truncated and untruncated log-probs differ by far more than TOL.
CASES = [(0.7, 1.0, -1), (0.7, 0.9, -1), (1.0, 1.0, 20), (0.8, 0.9, 50)]
# top-p keeps the smallest set of tokens reaching p; on a near-uniform distribution the tokens at the cut are
# within float noise of each other, so vLLM's logits and ours may keep a different one there: the normaliser then
# moves by about one token's probability (~1/512 of the mass, ~2e-3 in log space).
TOP_P_TOL = 5e-3


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_path):
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", batch_size=8)
    yield engine
    engine.close()


def trainer_logprobs(model, sample, temperature: float) -> torch.Tensor:
    """The trainer's own code path without truncation: `sequence_logprobs` at the rollout temperature, response
    positions only."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
    return logp[0, len(sample.prompt_ids) - 1 :]


def check_processed(engine, model, temperature: float, top_p: float, top_k: int) -> dict:
    spec = SamplingSpec(n=2, max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, seed=21,
                        ignore_eos=True)
    diffs = {"reference": 0.0, "trainer_minus_rollout_max": -float("inf"), "truncation": 0.0}
    for s in engine.generate(PROMPTS, spec):
        got = torch.tensor(s.logprobs)
        logits = response_logits(model, s)
        ref = reference_logprobs(logits, s.response_ids, temperature, top_p, top_k)
        diffs["reference"] = max(diffs["reference"], float((got - ref).abs().max()))
        trainer = trainer_logprobs(model, s, temperature)
        # untruncated: pi_untruncated / pi_rollout = the kept mass <= 1 per token
        diffs["trainer_minus_rollout_max"] = max(diffs["trainer_minus_rollout_max"], float((trainer - got).max()))
        diffs["truncation"] = max(diffs["truncation"], float((got - trainer).abs().max()))
        raw = F.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        diffs["raw"] = max(diffs.get("raw", 0.0), float((got - raw).abs().max()))
    print(f"T={temperature} top_p={top_p} top_k={top_k}:", {k: f"{v:.2e}" for k, v in diffs.items()})
    return diffs


def _assert_processed(d: dict, temperature: float, top_p: float, top_k: int) -> None:
    truncated = top_p < 1.0 or top_k > 0
    assert d["reference"] < (TOP_P_TOL if top_p < 1.0 else TOL), d
    assert d["raw"] > 1e-2, f"the log-probs must not be the raw distribution's: {d}"
    if truncated:
        assert d["truncation"] > 1e-2 and d["trainer_minus_rollout_max"] < TOL, d
    else:  # temperature only: exactly the trainer's temperature-scaled log-probs
        assert d["truncation"] < TOL, d


@pytest.mark.parametrize("temperature, top_p, top_k", CASES)
def test_vllm_returns_the_sampled_distributions_logprobs(vllm_rollout, hf_model, temperature, top_p, top_k):
    _assert_processed(check_processed(vllm_rollout, hf_model, temperature, top_p, top_k), temperature, top_p, top_k)


@pytest.mark.parametrize("temperature, top_p, top_k", CASES)
def test_hf_backend_returns_the_sampled_distributions_logprobs(hf_rollout, hf_model, temperature, top_p, top_k):
    _assert_processed(check_processed(hf_rollout, hf_model, temperature, top_p, top_k), temperature, top_p, top_k)


def test_engine_runs_in_processed_mode_and_the_canary_stays_raw(vllm_rollout, hf_model):
    """The canary scores prompt log-probs, which skip the sampling processors: it compares raw with raw whatever the
    run's temperature, so a sync check after temperature-0.7 rollouts still passes at the float32 threshold."""
    assert vllm_rollout.stats()["vllm_options"]["logprobs_mode"] == "processed_logprobs"
    vllm_rollout.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1))
    assert SyncCanary(PROBE, threshold=TOL).check(hf_model, vllm_rollout) < TOL


def test_rl_step_with_temperature_and_the_correction(vllm_rollout, tiny_model_path, dist_single, tmp_path):
    """Temperature 0.7 with rl.mismatch tis is accepted and trains; the rollout's log-probs equal the trainer's
    temperature-scaled ones (mismatch KL ~ 0: same weights before the first update, float32)."""
    from ds_rlhf.config import parse_config
    from ds_rlhf.recipes.rl import RLTrainer
    from tests.recipes.stores import prompt_store

    store = prompt_store(tmp_path, tiny_model_path, lengths=(4, 8, 6, 5))
    cfg = parse_config(["--model.path", str(tiny_model_path), "--data.train", str(store), "--run.output_dir",
                        str(tmp_path / "run"), "--run.steps", "1", "--reward.fn", "format",
                        "--rl.prompts_per_step", "4", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
                        "--rollout.temperature", "0.7", "--rl.mismatch", "tis", "--optim.micro_batch_size", "8",
                        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"])
    try:
        history = RLTrainer(cfg, rollout=vllm_rollout).train()
    finally:
        restore_checkpoint_weights(vllm_rollout, tiny_model_path)
    assert len(history) == 1
    assert history[0]["mismatch/kl_rollout_trainer"] < 1e-6, history[0]
    assert history[0]["sync/canary_max_abs_diff"] < 1e-3
