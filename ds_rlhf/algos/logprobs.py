"""Token log-probabilities (and entropy) of the sampled tokens, computed without full-batch fp32 logits.

For a batch of ``N`` tokens and a vocabulary of ``V``, the naive path materialises ``[N, V]`` logits, upcasts them
to fp32 and keeps a ``log_softmax`` copy for backward: several ``4 N V`` bytes (gigabytes for ``V = 150k``).
``token_logprobs_from_hidden`` instead projects hidden states through the LM head ``chunk_size`` tokens at a time,
keeps only the per-token ``logsumexp`` (``N`` floats) and recomputes each chunk's logits in backward, so peak extra
memory is ``O(chunk_size * V)`` regardless of ``N``.

Position convention: ``hidden[t]`` predicts ``targets[t]``; shift (``hidden[:, :-1]``, ``input_ids[:, 1:]``) before
calling. The LM head weight must be the full ``[V, H]`` matrix (gather it first under ZeRO-3).

Truncated sampling (``top_p < 1`` or ``top_k > 0``): the log-probs and the entropy are those of the tempered
distribution restricted to the kept set of `ds_rlhf.algos.truncation` (why that set, and its exactness, is
documented there) and renormalised. Each chunk's per-token threshold is computed in forward (one sort of the chunk,
in row blocks) and kept (``N`` floats) for backward, so the kept set of backward is the one of forward. Without
truncation the functions run exactly the untruncated operations.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.truncation import kept_mask, kept_threshold, truncates


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _low_precision(weight: torch.Tensor) -> bool:
    """bf16/fp16 head weights: the backward GEMMs run in that dtype (fp32 accumulation inside each GEMM, chunks
    summed in fp32) instead of fp32 GEMMs, which run at a small fraction of the tensor-core rate on GPUs."""
    return weight.dtype in (torch.bfloat16, torch.float16)


def _scaled(raw, bias, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    z = raw.to(dtype)
    if bias is not None:
        z = z + bias.to(dtype)
    return z / temperature if temperature != 1.0 else z


def _chunk_stats(raw, bias, targets, temperature: float, with_entropy: bool, dtype: torch.dtype, threshold=None):
    """One chunk's (logp of the targets, logsumexp, entropy or None) from its raw logits ``h W^T``.

    All the per-logit work of the forward in one function, so that on GPUs `torch.compile` fuses it into a few
    kernels that read the ``[chunk, V]`` logits once or twice instead of a dozen fp32 passes (see `_fused`).
    With a ``threshold`` (``[chunk]``) the distribution is restricted to the kept set (`kept_mask`)."""
    z = _scaled(raw, bias, temperature, dtype)
    if threshold is None:
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(1, targets[:, None]).squeeze(1) - lse
        entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1) if with_entropy else None
        return logp, lse, entropy
    kept = kept_mask(z, targets, threshold)
    lse = torch.logsumexp(z.masked_fill(~kept, -torch.inf), dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    probs = torch.exp(z - lse[:, None]).masked_fill(~kept, 0.0)
    entropy = lse - (probs * z).sum(dim=-1) if with_entropy else None
    return logp, lse, entropy


def _chunk_grad(raw, bias, targets, lse, grad_logp, grad_entropy, expected_logit, temperature: float,
                dtype: torch.dtype, out_dtype: torch.dtype, threshold=None):
    """``d loss / d (h W^T)`` for one chunk: ``onehot(y) g_lp - p (g_lp + g_H (z - E_p[z]))``, over temperature,
    in ``out_dtype`` (the dtype of the backward GEMMs). With a ``threshold``, ``p`` is the kept set's renormalised
    distribution (0 outside it; the set is piecewise constant in ``z``)."""
    z = _scaled(raw, bias, temperature, dtype)
    probs = torch.exp(z - lse[:, None])
    if threshold is not None:
        probs = probs.masked_fill(~kept_mask(z, targets, threshold), 0.0)
    g_lp = grad_logp[:, None]
    if grad_entropy is not None:
        grad_z = -probs * (g_lp + grad_entropy[:, None] * (z - expected_logit[:, None]))
    else:
        grad_z = -probs * g_lp
    grad_z = grad_z.scatter_add(1, targets[:, None], g_lp)
    if temperature != 1.0:
        grad_z = grad_z / temperature
    return grad_z.to(out_dtype)


_COMPILED: dict = {}


def _fused(fn, device: torch.device):
    """`fn` compiled with torch.compile (Inductor) on CUDA devices, `fn` itself elsewhere (CPU runs stay eager)."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Forward: per-chunk logits -> logp, entropy, logsumexp. Backward: recompute the chunk's logits and apply
    ``d logp_y / dz = onehot(y) - p`` and ``d H / dz = -p (z - E_p[z])`` (softmax Jacobian; ``H = lse - E_p[z]``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, with_entropy, ignore_index, top_p,
                top_k):
        dtype = _compute_dtype(hidden.dtype)
        num_tokens = hidden.shape[0]
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        logp = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(())
        threshold = torch.empty_like(logp) if truncates(top_p, top_k) else None
        stats = _fused(_chunk_stats, hidden.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            raw = hidden[start:end] @ weight.t()
            tau = None
            if threshold is not None:
                tau = threshold[start:end] = kept_threshold(_scaled(raw, bias, temperature, dtype), top_p, top_k)
            lp, chunk_lse, ent = stats(raw, bias, safe_targets[start:end], temperature, with_entropy, dtype, tau)
            logp[start:end], lse[start:end] = lp, chunk_lse
            if with_entropy:
                entropy[start:end] = ent
            del raw
        logp = torch.where(valid, logp, 0.0)
        if with_entropy:
            entropy = torch.where(valid, entropy, 0.0)
        else:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, safe_targets, valid, lse, entropy, threshold)
        ctx.config = (chunk_size, temperature, with_entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, valid, lse, entropy, threshold = ctx.saved_tensors
        chunk_size, temperature, with_entropy = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = lse.dtype
        grad_logp = torch.where(valid, grad_logp.to(dtype), 0.0)
        use_entropy = with_entropy and grad_entropy is not None
        expected_logit = None
        if use_entropy:
            grad_entropy = torch.where(valid, grad_entropy.to(dtype), 0.0)
            expected_logit = lse - entropy
        low = _low_precision(weight)
        gemm_dtype = weight.dtype if low else dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
        grad_of_chunk = _fused(_chunk_grad, hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            gz = grad_of_chunk(h @ weight.t(), bias, targets[start:end], lse[start:end], grad_logp[start:end],
                               grad_entropy[start:end] if use_entropy else None,
                               expected_logit[start:end] if use_entropy else None, temperature, dtype, gemm_dtype,
                               None if threshold is None else threshold[start:end])
            if need_hidden:
                grad_hidden[start:end] = (gz @ weight.to(gemm_dtype)).to(hidden.dtype)
            if need_weight:  # bf16/fp16: a tensor-core GEMM per chunk, summed over chunks in fp32
                grad_weight.add_(gz.t() @ h.to(gemm_dtype))
            if need_bias:
                grad_bias.add_(gz.sum(dim=0, dtype=dtype))
            del gz
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def token_logprobs_from_hidden(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                               chunk_size: int = 1024, temperature: float = 1.0, with_entropy: bool = False,
                               lm_head_bias: torch.Tensor | None = None,
                               ignore_index: int = -100, top_p: float = 1.0,
                               top_k: int = -1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax((h W^T + b) / temperature)[y]`` and optionally the entropy, per token, chunked over tokens;
    under truncated sampling (``top_p < 1`` or ``top_k > 0``) of that distribution restricted to the kept set
    and renormalised (see the module docstring), the entropy too.

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
                                                 int(ignore_index), float(top_p), int(top_k))
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
