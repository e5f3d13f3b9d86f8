"""Chunked per-token log-probs through the model equal the naive full-logits computation, padded and packed."""

from __future__ import annotations

import torch

from ds_rlhf.trainer.policy_forward import sequence_logprobs


def _naive(model, ids, attn):
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_matches_naive_logprobs_and_gradients(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.randint(0, 400, (3, 9))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    mask = attn[:, 1:].float()
    logp, entropy = sequence_logprobs(model, ids, attn, with_entropy=True, chunk_size=5)
    naive = _naive(model, ids, attn)
    assert torch.allclose(logp.double() * mask, naive * mask, atol=1e-5)
    assert entropy.shape == logp.shape and (entropy >= 0).all()
    (logp * mask).sum().backward()
    grad_chunked = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()
    (naive * mask).sum().backward()
    assert torch.allclose(grad_chunked.double(), model.get_output_embeddings().weight.grad.double(), atol=1e-4)


def test_packed_rows_do_not_attend_to_each_other(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from ds_rlhf.data.packing import pack_sequences

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    seqs = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13]]
    packed = pack_sequences(seqs)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, packed["input_ids"], None, position_ids=packed["position_ids"])
        singles = [sequence_logprobs(model, torch.tensor([s]), None)[0][0] for s in seqs]
    # position t predicts t+1; the positions that straddle a boundary are never trained (see trainer/sft.py)
    starts = [0, 5, 8]
    for s, seq, single in zip(starts, seqs, singles):
        assert torch.allclose(logp[0, s : s + len(seq) - 1], single, atol=1e-5)
