"""Chunked per-token log-probs through the model equal the naive full-logits computation, padded and packed."""

from __future__ import annotations

import torch

from ds_rlhf.engines.policy_forward import sequence_logprobs


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
    # position t predicts t+1; the positions that straddle a boundary are never trained (see recipes/sft.py)
    starts = [0, 5, 8]
    for s, seq, single in zip(starts, seqs, singles):
        assert torch.allclose(logp[0, s : s + len(seq) - 1], single, atol=1e-5)


def test_score_mask_scores_only_those_positions_with_the_same_values_and_gradients(tiny_model_path):
    """The response-only head: positions outside `score_mask` read 0, the selected ones (and every gradient of a
    loss over them) equal the full head's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.randint(0, 400, (3, 10))
    attn = torch.ones_like(ids)
    attn[2, 7:] = 0
    scored = torch.zeros(3, 9, dtype=torch.bool)
    scored[0, 4:] = True
    scored[1, 2:6] = True
    scored[2, 3:6] = True
    weights = torch.rand(3, 9) * scored

    def run(mask):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, ids, attn, with_entropy=True, chunk_size=4, score_mask=mask)
        ((logp * weights).sum() + (entropy * weights).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), entropy.detach(), grads

    full_logp, full_ent, full_grads = run(None)
    logp, ent, grads = run(scored)
    assert torch.allclose(logp[scored], full_logp[scored], atol=1e-6)
    assert torch.allclose(ent[scored], full_ent[scored], atol=1e-6)
    assert (logp[~scored] == 0).all() and (ent[~scored] == 0).all()
    assert full_logp[~scored].abs().min() > 0  # the full head did score them
    assert grads.keys() == full_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, full_grads[name], atol=1e-5), name


def test_score_mask_selecting_nothing_reads_zero_and_keeps_the_head_in_the_graph(tiny_model_path):
    """A zero-weight micro-batch (all-masked rows): every position reads 0 (nothing unmasked leaks into a loss),
    yet the head still runs, so its weight gets a (zero) gradient on every rank alike."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.randint(0, 400, (2, 6))
    logp, entropy = sequence_logprobs(model, ids, None, with_entropy=True, score_mask=torch.zeros(2, 5, dtype=bool))
    assert (logp == 0).all() and (entropy == 0).all()
    (logp.sum() + entropy.sum()).backward()
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and (grad == 0).all()


def test_score_mask_of_the_wrong_shape_is_refused(tiny_model_path):
    import pytest
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match="score_mask shape"):
        sequence_logprobs(model, torch.randint(0, 400, (2, 6)), None, score_mask=torch.ones(2, 6, dtype=torch.bool))
