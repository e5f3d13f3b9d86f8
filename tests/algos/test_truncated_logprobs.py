"""Log-probs under top-p / top-k (`algos/truncation.py`, the chunked head of `algos/logprobs.py`): the kept set is
vLLM's, the chunked values and gradients equal a dense per-row reference, gradcheck passes in float64, and without
truncation the chunked path runs no truncation code and gives the same bits as before."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

import ds_rlhf.algos.logprobs as logprobs_mod
from ds_rlhf.algos import token_logprobs_from_hidden
from ds_rlhf.algos.truncation import kept_threshold, truncated_logprobs_from_logits

CASES = [(0.7, 1.0, -1), (0.7, 0.9, -1), (1.0, 1.0, 5), (0.8, 0.6, 7), (1.3, 0.3, -1)]  # (T, top_p, top_k)


def _case(n=13, hidden=6, vocab=17, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.9
    b = torch.randn(vocab, generator=gen, dtype=dtype)
    y = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, b, y


def vllm_kept(z_row: list[float], top_p: float, top_k: int) -> set[int]:
    """vLLM's rule in Python floats: top-k keeps the k largest; top-p, on the top-k-renormalised probs sorted
    ascending, drops tokens whose cumulative mass from below is <= 1 - p (the largest always stays)."""
    order = sorted(range(len(z_row)), key=lambda v: z_row[v])
    kept = order[-top_k:] if 0 < top_k < len(z_row) else order
    if top_p < 1.0:
        top = max(z_row[v] for v in kept)
        weights = [math.exp(z_row[v] - top) for v in kept]
        total, cum, out = sum(weights), 0.0, []
        for i, (v, wv) in enumerate(zip(kept, weights)):
            cum += wv / total
            if cum > 1 - top_p + 1e-12 or i == len(kept) - 1:
                out.append(v)
        kept = out
    return set(kept)


def python_reference(h, w, b, y, temperature, top_p, top_k):
    logps, ents = [], []
    z_all = ((h @ w.t() + b) / temperature).tolist()
    for z, target in zip(z_all, y.tolist()):
        kept = vllm_kept(z, top_p, top_k) | {target}
        lse = math.log(sum(math.exp(z[v]) for v in kept))
        logps.append(z[target] - lse)
        ents.append(-sum(math.exp(z[v] - lse) * (z[v] - lse) for v in kept))
    return torch.tensor(logps, dtype=h.dtype), torch.tensor(ents, dtype=h.dtype)


@pytest.mark.parametrize("temperature, top_p, top_k", CASES)
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_chunked_truncated_logprobs_match_python_reference(temperature, top_p, top_k, chunk_size):
    h, w, b, y = _case()
    logp, ent = token_logprobs_from_hidden(h, w, y, chunk_size=chunk_size, temperature=temperature,
                                           with_entropy=True, lm_head_bias=b, top_p=top_p, top_k=top_k)
    ref_lp, ref_ent = python_reference(h, w, b, y, temperature, top_p, top_k)
    torch.testing.assert_close(logp, ref_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=1e-10)
    dense_lp, dense_ent = truncated_logprobs_from_logits(h @ w.t() + b, y, temperature, top_p, top_k)
    torch.testing.assert_close(dense_lp, ref_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dense_ent, ref_ent, atol=1e-10, rtol=1e-10)
    if top_p < 1.0 or top_k > 0:  # the cases do cut: the untruncated log-probs are larger in magnitude
        full, _ = token_logprobs_from_hidden(h, w, y, temperature=temperature, lm_head_bias=b)
        assert float((logp - full).max()) > 1e-2


def test_threshold_is_vllms_kept_set():
    z = torch.randn(40, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for top_p, top_k in [(0.9, -1), (1.0, 10), (0.5, 20), (0.05, -1)]:
        tau = kept_threshold(z, top_p, top_k)
        for row, t in zip(z.tolist(), tau.tolist()):
            assert {v for v, x in enumerate(row) if x >= t} == vllm_kept(row, top_p, top_k)
    assert torch.isinf(kept_threshold(z, 1.0, -1)).all() and torch.isinf(kept_threshold(z, 1.0, 50)).all()


@pytest.mark.parametrize("temperature, top_p, top_k", CASES[1:])
def test_gradcheck_float64(temperature, top_p, top_k):
    h, w, b, y = _case(n=6, hidden=4, vocab=9)
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))

    def fn(h_, w_, b_):
        lp, ent = token_logprobs_from_hidden(h_, w_, y, chunk_size=4, temperature=temperature, with_entropy=True,
                                             lm_head_bias=b_, top_p=top_p, top_k=top_k)
        return lp, ent

    assert gradcheck(fn, (h, w, b), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("temperature, top_p, top_k", CASES[1:])
def test_gradients_match_dense_autograd(temperature, top_p, top_k):
    h, w, b, y = _case(n=20, hidden=8, vocab=33, seed=5)
    coef = torch.randn(2, 20, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = []
    for chunked in (True, False):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        if chunked:
            lp, ent = token_logprobs_from_hidden(hh, ww, y, chunk_size=7, temperature=temperature, with_entropy=True,
                                                 lm_head_bias=bb, top_p=top_p, top_k=top_k)
        else:
            lp, ent = truncated_logprobs_from_logits(hh @ ww.t() + bb, y, temperature, top_p, top_k)
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
        grads.append((hh.grad, ww.grad, bb.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


def test_untruncated_path_runs_no_truncation_and_keeps_its_bits(monkeypatch):
    h, w, b, y = _case(dtype=torch.float32)
    before = token_logprobs_from_hidden(h, w, y, chunk_size=4, temperature=0.7, with_entropy=True, lm_head_bias=b)

    def boom(*args, **kwargs):
        raise AssertionError("the truncation code ran although nothing is truncated")

    monkeypatch.setattr(logprobs_mod, "kept_threshold", boom)
    monkeypatch.setattr(logprobs_mod, "kept_mask", boom)
    for top_p, top_k in [(1.0, -1), (1.0, 0)]:
        after = token_logprobs_from_hidden(h, w, y, chunk_size=4, temperature=0.7, with_entropy=True,
                                           lm_head_bias=b, top_p=top_p, top_k=top_k)
        assert all(torch.equal(a, c) for a, c in zip(before, after))
    # one chunk: the same bits as a direct evaluation of the untruncated operations
    one, _ = token_logprobs_from_hidden(h, w, y, chunk_size=1000, temperature=0.7, lm_head_bias=b, top_p=1.0)
    z = (h @ w.t() + b) / 0.7
    assert torch.equal(one, z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1))
