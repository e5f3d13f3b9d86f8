"""The kept set of top-k / top-p sampling, as a per-token logit threshold, for log-probs under truncated sampling.

When a rollout samples with ``top_p < 1`` or ``top_k > 0`` it draws each token from the tempered distribution
restricted to a kept set ``K`` and renormalised, and the rollout log-probs are that distribution's (vLLM's
``processed_logprobs``). The trainer's log-probs (policy, old policy, reference) must then be of the same truncated,
renormalised distribution, or the PPO ratio and the mismatch correction compare ``pi_K`` with an untruncated
``pi`` (a per-token bias of ``log pi(K)``, the kept mass).

Design: the trainer recomputes ``K`` from its own logits with vLLM's rule, not from data sent back by the engine.
vLLM (0.32; likewise 0.26) returns, per sampled token, its processed log-prob and optionally the top-``N`` processed
log-probs; it exposes no cut-off (threshold logit or kept-set size). The top-``N`` list holds the whole kept set only
for ``N >= |K|``, i.e. a few hundred to thousands of (id, float) pairs per token under top-p, and a custom logits
processor runs before vLLM's truncation, so it cannot see the cut-off either (it could only recompute it, which is
what the trainer does here). So:

- ``K = {v : z_v >= tau} | {y}`` with ``z`` the tempered logits, ``y`` the sampled token and ``tau`` the smallest
  kept logit under vLLM's rule (``kept_threshold``): top-k keeps ``z >= `` the k-th largest; top-p then, on the
  top-k renormalised probabilities sorted ascending, drops the tokens whose cumulative mass from below is
  ``<= 1 - p`` (the largest always stays). vLLM's kept set is the same threshold set except for exact ties at the
  cut (vLLM keeps them in sort order, here all are kept).
- Where the trainer's logits equal the engine's (same weights; float32 on CPU in the tests) ``K`` is the engine's
  and the log-probs equal vLLM's processed ones. Where they differ (bf16, other kernels, the policy after an
  update) a token at the cut can fall on the other side: on a near-uniform distribution that moves the normaliser
  by about one token's probability (measured on the tiny model: within 5e-3, the tolerance of the rollout tests);
  on a peaked one the tokens at the cut carry little mass. Adding ``y`` keeps every log-prob finite where the
  sampled token falls outside the trainer's set.
- For a new policy ``theta`` the set is recomputed from ``theta``'s logits: ``pi_theta,K`` is the distribution that
  policy would sample from with the same settings. ``K`` is piecewise constant in the logits, so the gradient of
  ``log pi_K(y) = z_y - logsumexp_K(z)`` is ``onehot(y) - pi_K`` (zero outside ``K``), exact almost everywhere.
"""

from __future__ import annotations

import torch

ROW_BLOCK = 256  # rows sorted at once: bounds the sort's extra memory to ROW_BLOCK x V values and indices


def truncates(top_p: float, top_k: int) -> bool:
    """Whether sampling with these settings truncates (top_p < 1 or top_k > 0)."""
    return top_p < 1.0 or top_k > 0


def _block_threshold(z: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    vocab = z.shape[-1]
    use_k = 0 < top_k < vocab
    if top_p >= 1.0:
        if not use_k:
            return torch.full(z.shape[:1], -torch.inf, dtype=z.dtype, device=z.device)
        return z.topk(top_k, dim=-1).values[:, -1]
    xs = z.sort(dim=-1).values  # ascending, as vLLM's apply_top_k_top_p_pytorch
    if use_k:
        xs = xs.masked_fill(xs < xs[:, vocab - top_k : vocab - top_k + 1], -torch.inf)
    drop = xs.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False
    first_kept = drop.sum(dim=-1)  # cumsum is monotone: the dropped tokens are a prefix
    return xs.gather(1, first_kept[:, None]).squeeze(1)


@torch.no_grad()
def kept_threshold(z: torch.Tensor, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """Per row of tempered logits ``z`` ``[N, V]``, the smallest logit that top-k then top-p (vLLM's rule) keep:
    ``[N]``, ``-inf`` where nothing is cut. The kept set is ``z >= threshold``. No gradient (a set boundary)."""
    if z.dim() != 2:
        raise ValueError(f"kept_threshold expects [N, V] logits, got shape {tuple(z.shape)}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not truncates(top_p, top_k) or z.shape[0] == 0:
        return torch.full(z.shape[:1], -torch.inf, dtype=z.dtype, device=z.device)
    return torch.cat([_block_threshold(z[i : i + ROW_BLOCK], top_p, top_k)
                      for i in range(0, z.shape[0], ROW_BLOCK)])


def kept_mask(z: torch.Tensor, targets: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` bool: the kept set ``z >= threshold`` plus each row's target token."""
    kept = z >= threshold[:, None]
    return kept.scatter(1, targets[:, None], True)


def truncated_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                                   top_p: float = 1.0, top_k: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reference for logits in memory (``[N, V]``): per row, the log-prob of ``targets`` and the entropy of
    ``softmax(z)`` restricted to the kept set (``z = logits / temperature`` in at least fp32), autograd through
    ``z``. Without truncation: the tempered distribution's."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    kept = kept_mask(z, targets, kept_threshold(z.detach(), top_p, top_k))
    logp_all = torch.log_softmax(z.masked_fill(~kept, -torch.inf), dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all.masked_fill(~kept, 0.0)).sum(dim=-1)
    return logp, entropy
