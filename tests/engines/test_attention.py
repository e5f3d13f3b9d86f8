"""Attention selection and the torch varlen glue.

varlen_attn itself is CUDA-only, so on CPU the glue (cu_seqlens from position ids, unpadding, GQA, layouts) is
tested with a reference kernel that runs causal SDPA on each segment; the real kernel is covered by
bench/attention.py on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_rlhf.engines import attention as attn
from ds_rlhf.engines.models import load_causal_lm
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]


def reference_varlen(q, k, v, cu, max_len, scale, window=None):
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, scale=scale).transpose(0, 1)
    return out


def _packed(lengths, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    seqs = [torch.randint(5, 300, (n,), generator=gen) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return seqs, torch.cat(seqs).unsqueeze(0), pos


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    cu, longest = attn.cu_seqlens_from_position_ids(pos, 2, 6)
    assert cu.tolist() == [0, 3, 5, 6, 12] and longest == 6 and cu.dtype == torch.int32


def test_sdpa_handles_packed_rows_when_cache_is_off(tiny_model_path):
    """transformers builds the block-diagonal mask from position_ids (only without a KV cache)."""
    model = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa").eval()
    seqs, packed, pos = _packed([7, 4, 9])
    with torch.no_grad():
        out = model(input_ids=packed, position_ids=pos).logits[0]  # load_causal_lm turned the cache off
        pieces = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(out, pieces, atol=1e-5, rtol=0)


def test_varlen_glue_matches_sdpa(tiny_model_path, monkeypatch):
    monkeypatch.setattr(attn, "varlen_kernel", reference_varlen)
    attn.register_torch_varlen()
    sdpa = load_causal_lm(tiny_model_path, dtype="fp32", attn_impl="sdpa").eval()
    from transformers import AutoModelForCausalLM

    varlen = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn.VARLEN_NAME).eval()
    seqs, packed, pos = _packed([7, 4, 9])
    with torch.no_grad():
        expect = torch.cat([sdpa(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
        got = varlen(input_ids=packed, position_ids=pos, use_cache=False).logits[0]
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)
        # Padded batch (left and right): the 2D mask path gathers real tokens, attends, scatters back.
        ids = seqs[2][:6].unsqueeze(0).repeat(2, 1)
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
        ids[0, 4:], ids[1, 2:] = 3, ids[0, :4].clone()
        pos2 = (mask.cumsum(-1) - 1).clamp(min=0)
        a = varlen(input_ids=ids, attention_mask=mask, position_ids=pos2, use_cache=False).logits
        b = sdpa(input_ids=ids, attention_mask=mask, position_ids=pos2, use_cache=False).logits
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=0)
        torch.testing.assert_close(a[0, :4], a[1, 2:], atol=1e-5, rtol=0)


def test_selection_on_cpu_is_measured_and_overridable(tmp_path, monkeypatch):
    assert not attn.varlen_works("cpu", torch.bfloat16)  # measured: NotImplementedError on CPU
    assert attn.select_attn_impl("auto", "cpu", torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="not usable on cpu"):
        attn.select_attn_impl(attn.VARLEN_NAME, "cpu", torch.bfloat16)
    choice = tmp_path / "choice.json"
    choice.write_text(json.dumps({"cpu|float32": {"impl": "eager"}}))
    monkeypatch.setenv("DS_RLHF_ATTN_CHOICE", str(choice))
    assert attn.select_attn_impl("auto", "cpu", torch.float32) == "eager"
    assert attn.select_attn_impl("auto", "cpu", torch.bfloat16) == "sdpa"  # nothing measured for bf16


def test_auto_skips_varlen_for_padded_rows(tmp_path, monkeypatch):
    """Padded RL micro-batches: "auto" takes sdpa over torch_varlen (measured faster on the H200 for padded rows);
    packed rows keep torch_varlen; a recorded choice still wins; an explicit name is honoured."""
    monkeypatch.setattr(attn, "available_impls", lambda device, dtype: [attn.VARLEN_NAME, "sdpa", "eager"])
    monkeypatch.setattr(attn, "register_torch_varlen", lambda: attn.VARLEN_NAME)
    monkeypatch.setenv("DS_RLHF_ATTN_CHOICE", str(tmp_path / "none.json"))
    assert attn.select_attn_impl("auto", "cuda", torch.bfloat16, padded=True) == "sdpa"
    assert attn.select_attn_impl("auto", "cuda", torch.bfloat16) == attn.VARLEN_NAME  # packed rows
    assert attn.select_attn_impl(attn.VARLEN_NAME, "cuda", torch.bfloat16, padded=True) == attn.VARLEN_NAME
    monkeypatch.setattr(attn, "measured_choice", lambda device, dtype: attn.VARLEN_NAME)
    assert attn.select_attn_impl("auto", "cuda", torch.bfloat16, padded=True) == attn.VARLEN_NAME


@pytest.mark.extended
def test_attention_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "attn.json"
    cmd = [sys.executable, str(ROOT / "bench" / "attention.py"), "--hidden", "128", "--heads", "2", "--kv-heads",
           "1", "--lengths", "32,16,8", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    by = {(r["impl"], r["layout"]): r for r in res["results"]}
    assert by[("sdpa", "packed")]["ok"] and by[("eager", "padded")]["ok"]
    assert not by[(attn.VARLEN_NAME, "packed")]["ok"] and "error" in by[(attn.VARLEN_NAME, "packed")]
    assert res["choice"] in ("sdpa", "eager")
