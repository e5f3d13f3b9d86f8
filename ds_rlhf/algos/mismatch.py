"""Rollout/trainer mismatch: importance weights that correct for it, and metrics that expose it.

The rollout engine (vLLM) samples with its own kernels and possibly stale or differently-quantised weights, so its
token probabilities ``pi_rollout`` differ from the trainer's ``pi_trainer`` for the same tokens. The policy
gradient is then off-policy; weighting each token by ``pi_trainer / pi_rollout`` (truncated for variance)
corrects it. A failed weight sync shows up at once as a large ``mismatch/kl_rollout_trainer`` and a wide ratio
distribution (after a good sync the ratio sits within a few per cent of 1).
"""

from __future__ import annotations

import math

import torch

from ds_rlhf.algos.kl import kl_penalty
from ds_rlhf.algos.registry import MISMATCH_MODES

IS_MODES = ("token", "token_mask", "sequence", "sequence_mask")
RATIO_QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


@torch.no_grad()
def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float = 2.0, mode: str = "token", lower: float | None = None,
                         geometric: bool = False) -> torch.Tensor:
    """Importance weights ``[B, T]`` (detached, 0 where masked) for the rollout/trainer mismatch.

    With ``rho_t = pi_trainer(y_t) / pi_rollout(y_t)`` and the sequence ratio ``rho = prod_t rho_t`` (or the
    geometric mean ``exp(mean_t log rho_t)`` if ``geometric``):
    - ``token`` (TIS): ``w_t = min(rho_t, cap)``; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training" (fengyao.notion.site blog), eq. for truncated IS.
    - ``token_mask``: ``w_t = rho_t * [lower <= rho_t <= cap]`` (token-level masked IS).
    - ``sequence``: ``w_t = min(rho, cap)`` for every token of the sequence.
    - ``sequence_mask`` (MIS): ``w_t = rho * [lower <= rho <= cap]``, i.e. sequences whose ratio is out of bounds are
      dropped; Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch" (blog), sequence-level masked IS.
    ``lower`` defaults to no lower bound (0). Ratios are bounded in log space, so long sequences cannot overflow.
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if cap <= 0 or (lower is not None and lower > cap):
        raise ValueError(f"need 0 < lower <= cap, got lower={lower}, cap={cap}")
    valid = mask.bool()
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    log_ratio = torch.where(valid, (trainer_logp.detach() - rollout_logp.detach()).to(dtype), 0.0)
    log_cap = math.log(cap)
    log_lower = -math.inf if lower is None or lower <= 0 else math.log(lower)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
        if geometric:
            log_ratio = log_ratio / valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand(valid.shape)
    if mode.endswith("mask"):
        keep = (log_ratio <= log_cap) & (log_ratio >= log_lower)
        weights = torch.where(keep, torch.exp(log_ratio.clamp(max=log_cap)), 0.0)
    else:
        weights = torch.exp(log_ratio.clamp(max=log_cap))
    return torch.where(valid, weights, 0.0)


def _sorted_quantiles(x: torch.Tensor, qs: tuple[float, ...]) -> list[torch.Tensor]:
    """Linear-interpolation quantiles of a 1-D tensor (as ``numpy.quantile``), without ``torch.quantile``'s size cap."""
    xs, n = x.sort().values, x.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


@torch.no_grad()
def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     cap: float | None = None, lower: float | None = None) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics of ``rho_t = pi_trainer / pi_rollout`` over the valid tokens.

    - ``mismatch/kl_rollout_trainer``: k3 estimate of ``KL(pi_rollout || pi_trainer)`` (tokens were sampled by the
      rollout engine, so ``d = log pi_rollout - log pi_trainer`` and ``k3 = exp(-d) - 1 + d``; Schulman 2020);
      ``mismatch/kl_k1``: the k1 estimate ``mean(d)``.
    - ``mismatch/ratio_{mean,std,min,max}`` and ``mismatch/ratio_p{1,5,50,95,99}``.
    - ``mismatch/abs_logp_diff_{mean,max}``; ``mismatch/seq_abs_log_ratio_max`` (``|sum_t log rho_t|`` per sequence).
    - with ``cap`` (and ``lower``): ``mismatch/token_frac_outside`` and ``mismatch/seq_frac_outside``, the share of
      tokens / sequences that truncation or masking would touch.
    """
    valid = mask.bool()
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    trainer_logp, rollout_logp = trainer_logp.detach().to(dtype), rollout_logp.detach().to(dtype)
    log_ratio = torch.where(valid, trainer_logp - rollout_logp, 0.0)
    tokens = log_ratio[valid]
    zero = log_ratio.new_zeros(())
    prefix = "mismatch/"
    if tokens.numel() == 0:
        names = ["kl_rollout_trainer", "kl_k1", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
                 "abs_logp_diff_mean", "abs_logp_diff_max", "seq_abs_log_ratio_max"]
        names += [f"ratio_p{round(q * 100)}" for q in RATIO_QUANTILES]
        names += ["token_frac_outside", "seq_frac_outside"] if cap is not None else []
        return {prefix + n: zero.clone() for n in names}
    ratio = tokens.exp()
    out = {
        "kl_rollout_trainer": kl_penalty(rollout_logp[valid], trainer_logp[valid], "k3").mean(),
        "kl_k1": (-tokens).mean(),
        "ratio_mean": ratio.mean(),
        "ratio_std": ratio.std(unbiased=False),
        "ratio_min": ratio.min(),
        "ratio_max": ratio.max(),
        "abs_logp_diff_mean": tokens.abs().mean(),
        "abs_logp_diff_max": tokens.abs().max(),
    }
    for q, value in zip(RATIO_QUANTILES, _sorted_quantiles(ratio, RATIO_QUANTILES)):
        out[f"ratio_p{round(q * 100)}"] = value
    has_tokens = valid.any(dim=-1)
    seq_log_ratio = log_ratio.sum(dim=-1)[has_tokens]
    out["seq_abs_log_ratio_max"] = seq_log_ratio.abs().max()
    if cap is not None:
        log_cap = math.log(cap)
        log_lower = -math.inf if lower is None or lower <= 0 else math.log(lower)
        out["token_frac_outside"] = ((tokens > log_cap) | (tokens < log_lower)).to(dtype).mean()
        out["seq_frac_outside"] = ((seq_log_ratio > log_cap) | (seq_log_ratio < log_lower)).to(dtype).mean()
    return {prefix + k: v for k, v in out.items()}


def _is_mode(mode: str):
    def weights(trainer_logp, rollout_logp, mask, cap: float):
        return truncated_is_weights(trainer_logp, rollout_logp, mask, cap=cap, mode=mode)

    return weights


MISMATCH_MODES.register("tis", "token-level truncated importance weights min(rho_t, cap) (Yao et al. 2025)")(
    _is_mode("token"))
MISMATCH_MODES.register("mis", "sequence-level masked IS: sequences with rho > cap are dropped (Liu et al. 2025)")(
    _is_mode("sequence_mask"))
MISMATCH_MODES.register("off", "no correction: train as if the rollout engine sampled from the trainer's policy",
                        correction=False)(lambda trainer_logp, rollout_logp, mask, cap: None)
