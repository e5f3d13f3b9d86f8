"""Policy-gradient, value, entropy and KL losses over ``[B, T]`` token tensors, with the aggregation modes.

Inputs that are targets (old log-probs, advantages, returns, old values, importance weights) are detached here,
so the only gradient paths are through the current policy's ``logp`` / ``entropy`` and the critic's ``values``.
Metrics are detached 0-dim tensors (no host sync); token statistics are taken over the valid tokens.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.kl import kl_penalty
from ds_rlhf.algos.registry import AGGREGATIONS, POLICY_LOSSES


def _token_mean(masked, valid, const_norm):
    return masked.sum() / valid.sum().clamp(min=1)


def _seq_parts(masked, valid):
    tokens_per_seq = valid.sum(dim=-1)
    return masked.sum(dim=-1), tokens_per_seq, (tokens_per_seq > 0).sum().clamp(min=1)


def _seq_mean_token_sum(masked, valid, const_norm):
    seq_sums, _, num_seqs = _seq_parts(masked, valid)
    return seq_sums.sum() / num_seqs


def _seq_mean_token_mean(masked, valid, const_norm):
    seq_sums, tokens_per_seq, num_seqs = _seq_parts(masked, valid)
    return (seq_sums / tokens_per_seq.clamp(min=1)).sum() / num_seqs


def _seq_mean_token_sum_norm(masked, valid, const_norm):
    seq_sums, _, num_seqs = _seq_parts(masked, valid)
    norm = float(const_norm) if const_norm is not None else float(masked.shape[-1])
    if norm <= 0:
        raise ValueError(f"const_norm must be positive, got {norm}")
    return seq_sums.sum() / (num_seqs * norm)


AGGREGATIONS.register("token-mean", "every token weighs the same (DAPO)")(_token_mean)
AGGREGATIONS.register("seq-mean-token-sum", "per-sequence token sums, averaged over sequences")(_seq_mean_token_sum)
AGGREGATIONS.register("seq-mean-token-mean", "per-sequence token means, averaged (original GRPO)")(
    _seq_mean_token_mean)
AGGREGATIONS.register("seq-mean-token-sum-norm", "token sums over a constant, the generation budget (Dr.GRPO)",
                      aliases=("const-norm", "dr_grpo"))(_seq_mean_token_sum_norm)
AGG_MODES = AGGREGATIONS.names(with_aliases=False)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              const_norm: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values[B, T]`` to a scalar over the valid tokens (``S`` = rows with >= 1 valid token).

    - ``token-mean``: ``sum_{i,t} v / sum_{i,t} m`` (every token weighs the same; DAPO, Yu et al. 2025, eq. 8).
    - ``seq-mean-token-sum``: ``(1/S) sum_i sum_t v`` (long sequences weigh more).
    - ``seq-mean-token-mean``: ``(1/S) sum_i (sum_t v / |o_i|)`` (the original GRPO objective, Shao et al. 2024
      eq. 3; biased towards short correct / long wrong answers).
    - ``seq-mean-token-sum-norm`` (alias ``const-norm``): ``(1/S) sum_i sum_t v / C`` with a constant ``C``
      (``const_norm``, default ``T``, e.g. the generation budget) instead of the length; Dr.GRPO, Liu et al.
      2025, "Understanding R1-Zero-Like Training", sec. 3.2.
    Modes come from ``registry.AGGREGATIONS``.
    """
    reduce = AGGREGATIONS.get(mode).fn
    valid = mask.bool()
    masked = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return reduce(masked, valid, const_norm)


def masked_token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``x`` over the valid tokens (0 when there are none); for metrics."""
    return aggregate(x.detach(), mask, "token-mean")


def masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    valid = mask.bool()
    if not bool(valid.any()):
        return x.new_zeros(())
    fill = torch.finfo(x.dtype).min if largest else torch.finfo(x.dtype).max
    filled = torch.where(valid, x.detach(), fill)
    return filled.max() if largest else filled.min()


@POLICY_LOSSES.register("ppo", "clipped surrogate, asymmetric clip (clip-higher) and optional dual clip",
                        dual_clip=True)
def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", const_norm: float | None = None,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip and optional dual clip; returns ``(loss, metrics)``.

    ``r = exp(logp - old_logp)``, ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``
    (Schulman et al. 2017, PPO, eq. 7; decoupled ``clip_low``/``clip_high`` = DAPO's clip-higher, Yu et al. 2025,
    eq. 10). Dual clip for ``A < 0``: ``l = min(l, -c A)`` with ``c = dual_clip > 1`` (Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep RL", eq. 5). ``is_weights`` (e.g. truncated importance weights for the
    rollout/trainer mismatch, ``mismatch.truncated_is_weights``) multiply ``l`` per token before ``aggregate``.

    Metrics: ``clip_frac`` (tokens on a clipped, gradient-free branch), ``clip_frac_low``/``clip_frac_high``,
    ``dual_clip_frac``, ``approx_kl`` (k3 estimate of KL(old || new)), ``ratio_mean``/``ratio_min``/``ratio_max``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    valid = mask.bool()
    adv = advantages.detach()
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(surr, surr_clipped)
    dual_active = torch.zeros_like(valid)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, valid, agg, const_norm)

    with torch.no_grad():
        ratio_d = ratio.detach()
        low = (ratio_d < 1.0 - clip_low) & (adv < 0)
        high = (ratio_d > 1.0 + clip_high) & (adv > 0)
        metrics = {
            "clip_frac": masked_token_mean((low | high).to(ratio_d.dtype), valid),
            "clip_frac_low": masked_token_mean(low.to(ratio_d.dtype), valid),
            "clip_frac_high": masked_token_mean(high.to(ratio_d.dtype), valid),
            "dual_clip_frac": masked_token_mean(dual_active.to(ratio_d.dtype), valid),
            "approx_kl": masked_token_mean(torch.expm1(log_ratio.detach()) - log_ratio.detach(), valid),
            "ratio_mean": masked_token_mean(ratio_d, valid),
            "ratio_min": masked_extreme(ratio_d, valid, largest=False),
            "ratio_max": masked_extreme(ratio_d, valid, largest=True),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None, agg: str = "token-mean",
               const_norm: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression ``0.5 (V - R)^2``; clipped: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -e, e) - R)^2)``.

    Value clipping as in OpenAI baselines' PPO2 (discussed in Engstrom et al. 2020, "Implementation Matters in
    Deep Policy Gradients", sec. 3). Metrics: ``vf_clip_frac`` (tokens where the clipped term is the larger),
    ``value_mean``, ``explained_var = 1 - Var(R - V) / Var(R)``.
    """
    valid = mask.bool()
    returns, old_values = returns.detach(), old_values.detach()
    err = (values - returns).square()
    clipped_active = torch.zeros_like(valid)
    if clip is not None:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (values_clipped - returns).square()
        clipped_active = err_clipped > err
        err = torch.maximum(err, err_clipped)
    loss = aggregate(0.5 * err, valid, agg, const_norm)

    with torch.no_grad():
        v = values.detach()
        resid = returns - v
        var_returns = masked_token_mean((returns - masked_token_mean(returns, valid)).square(), valid)
        var_resid = masked_token_mean((resid - masked_token_mean(resid, valid)).square(), valid)
        metrics = {
            "vf_clip_frac": masked_token_mean(clipped_active.to(v.dtype), valid),
            "value_mean": masked_token_mean(v, valid),
            "explained_var": 1.0 - var_resid / var_returns.clamp(min=torch.finfo(v.dtype).tiny),
        }
    return loss, metrics


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
                  const_norm: float | None = None) -> torch.Tensor:
    """Aggregated policy entropy ``H = -sum_v pi(v) log pi(v)`` per token; the trainer adds ``-coef * H`` to the loss.

    Entropy regularisation: Williams & Peng 1991; Mnih et al. 2016 (A3C), eq. after (4). Detach it to report it.
    """
    return aggregate(entropy, mask, agg, const_norm)


def kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3",
            agg: str = "token-mean", const_norm: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-to-reference as a differentiable loss term: ``aggregate(k(logp, ref_logp))`` (GRPO, Shao et al. 2024,
    eq. 4 uses ``k3``); returns ``(loss, {"kl": token-mean of the estimate})``."""
    per_token = kl_penalty(logp, ref_logp.detach(), kind)
    return aggregate(per_token, mask, agg, const_norm), {"kl": masked_token_mean(per_token, mask)}
