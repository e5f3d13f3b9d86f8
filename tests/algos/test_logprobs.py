"""Chunked log-probs from hidden states: values and gradients equal the naive path; peak memory does not grow with
V x T the way the naive path's does."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.autograd import gradcheck

from ds_rlhf.algos import entropy_from_logits, logprobs_from_logits, naive_token_logprobs, token_logprobs_from_hidden

ROOT = Path(__file__).resolve().parents[2]


def _case(n=13, hidden=6, vocab=11, seed=0, dtype=torch.float64, bias=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.7
    b = torch.randn(vocab, generator=gen, dtype=dtype) if bias else None
    y = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, b, y


def ref_logp_entropy(h, w, b, y, temperature):
    """Python floats: explicit dot products, log-sum-exp and entropy per token."""
    logps, ents = [], []
    for hv, target in zip(h.tolist(), y.tolist()):
        z = [(sum(a * c for a, c in zip(hv, wv)) + (b[v].item() if b is not None else 0.0)) / temperature
             for v, wv in enumerate(w.tolist())]
        top = max(z)
        lse = top + math.log(sum(math.exp(x - top) for x in z))
        probs = [math.exp(x - lse) for x in z]
        logps.append(z[target] - lse)
        ents.append(-sum(p * math.log(p) for p in probs))
    return logps, ents


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_forward_matches_python_reference(chunk_size, temperature):
    h, w, b, y = _case()
    logp, ent = token_logprobs_from_hidden(h, w, y, chunk_size=chunk_size, temperature=temperature,
                                           with_entropy=True, lm_head_bias=b)
    ref_lp, ref_ent = ref_logp_entropy(h, w, b, y, temperature)
    torch.testing.assert_close(logp, torch.tensor(ref_lp, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(ent, torch.tensor(ref_ent, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    no_ent_lp, none = token_logprobs_from_hidden(h, w, y, chunk_size=chunk_size, temperature=temperature,
                                                 lm_head_bias=b)
    assert none is None and torch.equal(no_ent_lp, logp)


def _naive(h, w, b, y, temperature):
    logits = h @ w.t() + (b if b is not None else 0.0)
    z = logits / temperature
    return naive_token_logprobs(z, y), entropy_from_logits(z)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gradients_equal_naive(with_entropy, bias):
    h, w, b, y = _case(n=17, hidden=5, vocab=9, seed=1, bias=bias)
    gen = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(2, 17, generator=gen, dtype=torch.float64)
    params = [h, w] + ([b] if bias else [])

    def grads(fn):
        leaves = [p.clone().requires_grad_() for p in params]
        lp, ent = fn(*leaves)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
        return torch.autograd.grad(loss, leaves)

    chunked = grads(lambda hh, ww, bb=None: token_logprobs_from_hidden(
        hh, ww, y, chunk_size=5, temperature=0.8, with_entropy=with_entropy, lm_head_bias=bb))
    naive = grads(lambda hh, ww, bb=None: _naive(hh, ww, bb, y, 0.8))
    for got, want in zip(chunked, naive):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_gradcheck_float64():
    h, w, b, y = _case(n=5, hidden=3, vocab=7, seed=3)
    y[2] = -100  # an ignored position inside a chunk
    inputs = tuple(t.clone().requires_grad_() for t in (h, w, b))
    fn = lambda hh, ww, bb: token_logprobs_from_hidden(hh, ww, y, chunk_size=2, temperature=0.7, with_entropy=True,
                                                       lm_head_bias=bb)
    assert gradcheck(fn, inputs)


def test_batched_shape_ignore_index_and_partial_requires_grad():
    h, w, _, y = _case(n=12, hidden=4, vocab=8, seed=4, bias=False)
    y = y.clone()
    y[[1, 7]] = -100
    hb = h.view(3, 4, 4).clone().requires_grad_()
    logp, ent = token_logprobs_from_hidden(hb, w, y.view(3, 4), chunk_size=5, with_entropy=True)
    assert logp.shape == ent.shape == (3, 4)
    ref_lp, _ = ref_logp_entropy(h, w, None, y.clamp(min=0), 1.0)
    flat = logp.detach().reshape(-1)
    assert flat[1] == 0 and flat[7] == 0 and ent.reshape(-1)[7] == 0
    keep = [i for i in range(12) if i not in (1, 7)]
    torch.testing.assert_close(flat[keep], torch.tensor(ref_lp, dtype=torch.float64)[keep], atol=1e-12, rtol=1e-10)
    (logp.sum() + ent.sum()).backward()  # only hidden needs a gradient; the head is frozen
    assert hb.grad.shape == hb.shape and (hb.grad.view(12, 4)[[1, 7]] == 0).all() and w.grad is None
    with torch.no_grad():
        assert not token_logprobs_from_hidden(hb, w, y.view(3, 4))[0].requires_grad


def test_bfloat16_inputs_stay_close_to_float32():
    h, w, b, y = _case(n=32, hidden=16, vocab=40, seed=5, dtype=torch.float32)
    h16, w16, b16 = (t.to(torch.bfloat16).requires_grad_() for t in (h, w, b))
    logp, ent = token_logprobs_from_hidden(h16, w16, y, chunk_size=7, with_entropy=True, lm_head_bias=b16)
    assert logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert h16.grad.dtype == w16.grad.dtype == b16.grad.dtype == torch.bfloat16
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (h16, w16, b16))
    ref_lp, ref_ent = _naive(h32, w32, b32, y, 1.0)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_lp.detach(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h16.grad.float(), h32.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(w16.grad.float(), w32.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_logprobs_from_logits_and_entropy_match_reference(temperature):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 10, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 10, (2, 3), generator=gen)
    lp = logprobs_from_logits(logits, y, temperature)
    ent = entropy_from_logits(logits, temperature)
    for i in range(2):
        for t in range(3):
            z = [x / temperature for x in logits[i, t].tolist()]
            lse = math.log(sum(math.exp(x) for x in z))
            assert lp[i, t].item() == pytest.approx(z[y[i, t]] - lse, abs=1e-12)
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(x - lse) * (x - lse) for x in z), abs=1e-12)
    torch.testing.assert_close(naive_token_logprobs(logits / temperature, y), lp, atol=1e-12, rtol=0)
    assert gradcheck(lambda z: logprobs_from_logits(z, y, temperature), (logits[:, :, :6].clone().requires_grad_(),))


_MEMORY_SCRIPT = """
import json, resource, sys, torch
from ds_rlhf.algos import naive_token_logprobs, token_logprobs_from_hidden
torch.set_num_threads(1)
mode, tokens, vocab, hidden, chunk = sys.argv[1], *map(int, sys.argv[2:])
def run(n, v):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = (torch.randn(v, hidden, generator=gen) * 0.05).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen)
    if mode == "naive":
        logp = naive_token_logprobs(h @ w.t(), y)
    else:
        logp, _ = token_logprobs_from_hidden(h, w, y, chunk_size=chunk)
    logp.sum().backward()
    return float(logp.detach().sum()), float(h.grad.abs().sum())
def status_kb(key):
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))
run(64, 128)  # warm-up: kernels and allocator state outside the measurement
try:  # reset the peak-RSS mark (Linux >= 4.0), so import-time peaks cannot hide the measured one
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, peak_of = status_kb("VmRSS"), lambda: status_kb("VmHWM")
except OSError:
    base, peak_of = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, lambda: resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss
result = run(tokens, vocab)
print(json.dumps({"delta_mb": (peak_of() - base) / 1024, "result": result}))
"""


def _peak_rss_mb(tmp_path, cases, hidden=32, chunk=64):
    """Run each ``(mode, tokens, vocab)`` case in its own process; return its peak-RSS growth in MiB and its result.

    glibc's mmap threshold is pinned: by default it adapts to freed block sizes, after which repeated
    [chunk, V] blocks come from a heap that fragments, and the peak then measures malloc's policy, not the tensors.
    """
    script = tmp_path / "peak.py"
    script.write_text(_MEMORY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    procs = {case: subprocess.Popen([sys.executable, str(script), case[0], str(case[1]), str(case[2]), str(hidden),
                                     str(chunk)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
                                    text=True)
             for case in cases}
    out = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        out[case] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_peak_memory_does_not_grow_with_vocab_times_tokens(tmp_path):
    """Peak RSS (VmHWM after resetting it; it sees torch's CPU allocations, tracemalloc does not) of one forward +
    backward.

    At T=1024 tokens the naive fp32 [T, V] logits alone are 64 MiB (V=16k) and 128 MiB (V=32k), and backward keeps
    more [T, V] copies; the chunked path only holds [chunk, V] blocks plus the [V, H] weight and its gradient.
    """
    small_v, big_v, tokens = 16384, 32768, 1024
    cases = [(mode, tokens, v) for mode in ("naive", "chunked") for v in (small_v, big_v)]
    cases.append(("chunked", 2 * tokens, big_v))
    out = _peak_rss_mb(tmp_path, cases)
    mb = {case: value["delta_mb"] for case, value in out.items()}
    logits_mb = {v: tokens * v * 4 / 2**20 for v in (small_v, big_v)}
    for v in (small_v, big_v):  # same numbers from both paths
        for a, b in zip(out[("naive", tokens, v)]["result"], out[("chunked", tokens, v)]["result"]):
            assert a == pytest.approx(b, rel=1e-4)
    naive_small, naive_big = mb[("naive", tokens, small_v)], mb[("naive", tokens, big_v)]
    chunked_small, chunked_big = mb[("chunked", tokens, small_v)], mb[("chunked", tokens, big_v)]
    # naive holds at least one full fp32 [T, V] tensor, and doubling V adds at least that much again
    assert naive_small >= logits_mb[small_v] and naive_big - naive_small >= logits_mb[big_v] - logits_mb[small_v], mb
    # chunked stays far below a single logits tensor, and doubling V grows it far less than it grows naive
    assert chunked_small < 0.25 * naive_small and chunked_big < 0.25 * naive_big, mb
    assert chunked_big < 0.5 * logits_mb[big_v], mb
    assert chunked_big - chunked_small < 0.25 * (naive_big - naive_small), mb
    # and twice the tokens at the larger V costs the chunked path almost nothing (naive: +128 MiB of logits alone)
    assert mb[("chunked", 2 * tokens, big_v)] - chunked_big < 0.1 * logits_mb[big_v], mb
