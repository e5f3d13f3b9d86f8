"""Token log-probabilities (and entropy) of the sampled tokens, computed without full-batch fp32 logits.

For a batch of ``N`` tokens and a vocabulary of ``V``, the naive path materialises ``[N, V]`` logits, upcasts them
to fp32 and keeps a ``log_softmax`` copy for backward: several ``4 N V`` bytes (gigabytes for ``V = 150k``).
``token_logprobs_from_hidden`` instead projects hidden states through the LM head ``chunk_size`` tokens at a time,
keeps only the per-token ``logsumexp`` (``N`` floats) and recomputes each chunk's logits in backward, so peak extra
memory is ``O(chunk_size * V)`` regardless of ``N``.

Position convention: ``hidden[t]`` predicts ``targets[t]``; shift (``hidden[:, :-1]``, ``input_ids[:, 1:]``) before
calling. The LM head weight must be the full ``[V, H]`` matrix (gather it first under ZeRO-3).
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden_chunk, weight, bias, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """``(h W^T + b) / temperature`` for one chunk, matmul in the parameters' dtype, result in ``dtype``."""
    logits = (hidden_chunk @ weight.t()).to(dtype)  # a fresh buffer either way, so in-place below is safe
    if bias is not None:
        logits.add_(bias.to(dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Forward: per-chunk logits -> logp, entropy, logsumexp. Backward: recompute the chunk's logits and apply
    ``d logp_y / dz = onehot(y) - p`` and ``d H / dz = -p (z - E_p[z])`` (softmax Jacobian; ``H = lse - E_p[z]``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, with_entropy, ignore_index):
        dtype = _compute_dtype(hidden.dtype)
        num_tokens = hidden.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        logp = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(())
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, bias, temperature, dtype)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = logits.gather(1, safe_targets[start:end, None]).squeeze(1) - chunk_lse
            if with_entropy:
                probs = torch.exp(logits - chunk_lse[:, None])
                entropy[start:end] = chunk_lse - probs.mul_(logits).sum(dim=-1)
                del probs
            del logits
        logp = torch.where(valid, logp, 0.0)
        if with_entropy:
            entropy = torch.where(valid, entropy, 0.0)
        else:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, lse, entropy)
        ctx.config = (chunk_size, temperature, with_entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, valid, lse, entropy = ctx.saved_tensors
        chunk_size, temperature, with_entropy = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = lse.dtype
        grad_logp = torch.where(valid, grad_logp.to(dtype), 0.0)
        use_entropy = with_entropy and grad_entropy is not None
        if use_entropy:
            grad_entropy = torch.where(valid, grad_entropy.to(dtype), 0.0)
            expected_logit = lse - entropy
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits = _chunk_logits(h, weight, bias, temperature, dtype)
            probs = torch.exp(logits - lse[start:end, None])
            g_lp = grad_logp[start:end, None]
            if use_entropy:
                # dz = -p * (g_logp + g_H * (z - E[z])), computed in place in the logits buffer
                grad_z = logits.sub_(expected_logit[start:end, None]).mul_(grad_entropy[start:end, None])
                grad_z.add_(g_lp).mul_(probs).neg_()
            else:
                grad_z = probs.mul_(g_lp).neg_()
            grad_z.scatter_add_(1, targets[start:end, None], g_lp)
            if temperature != 1.0:
                grad_z.div_(temperature)
            if need_hidden:
                grad_hidden[start:end] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_z.t(), h.to(dtype))
            if need_bias:
                grad_bias.add_(grad_z.sum(dim=0))
            del logits, probs, grad_z
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               chunk_size: int = 1024, temperature: float = 1.0, with_entropy: bool = False,
                               lm_head_bias: torch.Tensor | None = None,
                               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax((h W^T + b) / temperature)[y]`` and optionally the entropy, per token, chunked over tokens.

    ``hidden`` is ``[N, H]`` or ``[B, T, H]``; ``targets`` has the leading shape; outputs are fp32 (fp64 for fp64
    inputs) with that shape. Targets equal to ``ignore_index`` give 0 and no gradient. Autograd-correct for
    ``hidden``, ``lm_head_weight`` and ``lm_head_bias``; equals ``naive_token_logprobs`` up to float rounding.
    Entropy: ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (Shannon entropy of the tempered distribution).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    lead_shape = hidden.shape[:-1]
    if targets.shape != lead_shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != hidden leading shape {tuple(lead_shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _ChunkedLinearLogProbs.apply(flat_hidden, lm_head_weight, lm_head_bias, targets.reshape(-1).long(),
                                                 int(chunk_size), float(temperature), bool(with_entropy),
                                                 int(ignore_index))
    return logp.view(lead_shape), entropy.view(lead_shape) if with_entropy else None


def naive_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float())`` gathered at ``targets`` (materialises the full fp32 copy)."""
    logits = logits.to(_compute_dtype(logits.dtype))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``z_y - logsumexp(z)`` with ``z = logits / temperature`` in at least fp32; for logits already in memory
    (e.g. from a model forward). Avoids the separate ``log_softmax`` output that the naive path keeps."""
    z = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of ``z = logits / temperature``."""
    z = logits.to(_compute_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
