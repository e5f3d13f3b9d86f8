"""Policy-gradient losses beside PPO's clipped surrogate (`losses.policy_loss`): GSPO, GSPO-token, CISPO, SAPO, GMPO.

Each is a pure function with PPO's call signature, ``(logp, old_logp, advantages, mask, clip_low, clip_high,
dual_clip, agg, const_norm, is_weights) -> (loss, metrics)`` on ``[B, T]`` token tensors, registered in
``registry.POLICY_LOSSES`` (``--rl.policy_loss NAME``). A loss that takes more settings names them in its
registration (``options={"kwarg": "rl_config_field"}``) and the trainer passes those too. ``clip_low`` /
``clip_high`` keep their PPO meaning where a loss clips a ratio (GSPO, CISPO) and are log-ratio bounds for GMPO;
SAPO does not clip. Dual clip is PPO's alone: the others refuse ``dual_clip``.

Sequence-level losses (GSPO, GMPO) put each sequence's loss on every one of its valid tokens, so ``agg`` reduces
them like token losses: ``seq-mean-token-mean`` gives the papers' ``(1/G) sum_i loss_i``; ``token-mean`` weighs a
sequence by its length. As in ``losses``, targets (old log-probs, advantages, importance weights) are detached and
metrics are detached 0-dim tensors over the valid tokens.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.losses import aggregate, masked_extreme, masked_token_mean
from ds_rlhf.algos.registry import POLICY_LOSSES

SAPO_TAU_MIN = 1e-6  # the smallest SAPO temperature (rl.sapo_tau_pos / rl.sapo_tau_neg)


def _refuse_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip is a PPO setting; the {name} loss does not take it (got {dual_clip})")


def _seq_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]``: the mean of ``x`` over each row's valid tokens (0 for a row without any)."""
    zeros = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, x, zeros).sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)


def _ratio_metrics(log_ratio: torch.Tensor, valid: torch.Tensor, clipped: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics every policy loss reports: ``clip_frac`` (tokens the loss clipped), ``approx_kl`` (k3 estimate of
    KL(old || new)), ``ratio_mean/min/max`` of the token ratio ``pi / pi_old``."""
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        ratio = torch.exp(log_ratio)
        return {
            "clip_frac": masked_token_mean(clipped.to(ratio.dtype), valid),
            "approx_kl": masked_token_mean(torch.expm1(log_ratio) - log_ratio, valid),
            "ratio_mean": masked_token_mean(ratio, valid),
            "ratio_min": masked_extreme(ratio, valid, largest=False),
            "ratio_max": masked_extreme(ratio, valid, largest=True),
        }


def _finish(per_token, valid, agg, const_norm, is_weights):
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    return aggregate(per_token, valid, agg, const_norm)


def _gspo(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, const_norm, is_weights, *,
          sequence_advantage: bool, name: str):
    _refuse_dual_clip(name, dual_clip)
    valid = mask.bool()
    zeros = torch.zeros((), dtype=logp.dtype, device=logp.device)
    token_log_ratio = torch.where(valid, logp - old_logp.detach(), zeros)
    seq_log_ratio = _seq_mean(token_log_ratio, valid)  # log s_i
    # s_{i,t} = sg[s_i] * pi_t / sg[pi_t]: the value of s_i, the gradient s_i * grad log pi_t
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + (logp - logp.detach()))
    adv = advantages.detach()
    if sequence_advantage:
        adv = _seq_mean(adv, valid)[:, None].expand_as(logp)
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _finish(torch.maximum(surr, surr_clipped), valid, agg, const_norm, is_weights)
    with torch.no_grad():
        r = ratio.detach()
        clipped = ((r < 1.0 - clip_low) & (adv < 0)) | ((r > 1.0 + clip_high) & (adv > 0))
        metrics = _ratio_metrics(token_log_ratio, valid, clipped)
        seq_ratio = torch.exp(seq_log_ratio.detach())
        rows = valid.any(dim=-1)
        metrics["seq_ratio_mean"] = torch.where(rows, seq_ratio, 0.0).sum() / rows.sum().clamp(min=1)
    return loss, metrics


@POLICY_LOSSES.register("gspo", "GSPO: sequence-level ratio and clip (Zheng et al. 2025); use the paper's "
                        "--rl.clip_low 3e-4 --rl.clip_high 4e-4 and --rl.loss_agg seq-mean-token-mean")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip: float | None = None,
              agg: str = "seq-mean-token-mean", const_norm: float | None = None,
              is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, eqs. 5-7).

    ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp((1/|y_i|) sum_t log(pi_t / pi_old_t))``,
    ``l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))`` with ``A_i`` the mean of the sequence's
    token advantages (GRPO's advantage, which is the same at every token); objective ``(1/G) sum_i -l_i``
    (``agg="seq-mean-token-mean"``). Computed in the GSPO-token form (eq. 13) with ``A_{i,t} = A_i``, which has
    the same value and gradient ``-A_i s_i (1/|y_i|) sum_t grad log pi_t``; the whole sequence is clipped or not.
    The paper's ranges are ``clip_low=3e-4``, ``clip_high=4e-4`` (sec. 5.1): a sequence ratio moves far less than
    a token ratio. Metrics as PPO's plus ``seq_ratio_mean``.
    """
    return _gspo(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, const_norm, is_weights,
                 sequence_advantage=True, name="gspo")


@POLICY_LOSSES.register("gspo-token", "GSPO-token: GSPO's sequence ratio with per-token advantages (Zheng et al. "
                        "2025, eq. 13); for token-level advantages (GAE, REINFORCE++)")
def gspo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 3e-4, clip_high: float = 4e-4, dual_clip: float | None = None,
                    agg: str = "seq-mean-token-mean", const_norm: float | None = None,
                    is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, eqs. 13-14).

    ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]`` (value ``s_i``, the sequence ratio of ``gspo_loss``; gradient
    ``s_i grad log pi_t``), ``l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - clip_low, 1 + clip_high))``.
    Equal to ``gspo_loss`` in value and gradient when every token of a sequence has the same advantage.
    """
    return _gspo(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, agg, const_norm, is_weights,
                 sequence_advantage=False, name="gspo-token")


@POLICY_LOSSES.register("cispo", "CISPO: REINFORCE with clipped, stop-gradient IS weights, no token loses its "
                        "gradient (MiniMax 2025); e.g. --rl.clip_high 4 (weights capped at 5)")
def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
               agg: str = "token-mean", const_norm: float | None = None,
               is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585, eqs. 4-5).

    ``r = pi / pi_old``, ``w = sg[clip(r, 1 - clip_low, 1 + clip_high)]``, ``l_t = -w A_t log pi_t``: the
    gradient ``-w A_t grad log pi_t`` is REINFORCE weighted by the clipped importance weight, so a token whose
    ratio leaves the range keeps its gradient (PPO drops it). The paper's objective is token-level
    (``agg="token-mean"``). The loss value is ``-w A log pi``, not comparable with PPO's ``-A r``. ``clip_frac``
    counts tokens whose weight was clipped.
    """
    _refuse_dual_clip("cispo", dual_clip)
    valid = mask.bool()
    log_ratio = logp.detach() - old_logp.detach()
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _finish(-weight * advantages.detach() * logp, valid, agg, const_norm, is_weights)
    metrics = _ratio_metrics(log_ratio, valid, (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high))
    return loss, metrics


@POLICY_LOSSES.register("sapo", "SAPO: a soft sigmoid gate on the token ratio instead of a hard clip (Gao et al. "
                        "2025); temperatures --rl.sapo_tau_pos/--rl.sapo_tau_neg",
                        options={"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"})
def sapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
              agg: str = "seq-mean-token-mean", const_norm: float | None = None,
              is_weights: torch.Tensor | None = None, *, tau_pos: float = 1.0,
              tau_neg: float = 1.05) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347, eqs. 4-6).

    ``r = pi / pi_old``, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` where ``A > 0`` and
    ``tau_neg`` elsewhere, ``l_t = -f(r) A_t``. Its gradient ``-sigmoid'(tau (r-1)) * 4 * r A grad log pi`` equals
    the unclipped policy gradient at ``r = 1`` and fades smoothly as ``r`` moves away, faster for ``tau_neg >
    tau_pos`` (negative advantages are the less stable ones); defaults 1.0 / 1.05 as in the paper. The paper
    averages per sequence (``agg="seq-mean-token-mean"``). On policy the loss reads ``-(2 / tau) A``.
    ``clip_low`` / ``clip_high`` are not used; ``clip_frac`` is 0.
    """
    _refuse_dual_clip("sapo", dual_clip)
    if tau_pos < SAPO_TAU_MIN or tau_neg < SAPO_TAU_MIN:  # the gate is 4 / tau: 1e-45 makes it inf in float32
        raise ValueError(f"SAPO temperatures must be >= {SAPO_TAU_MIN:g}, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    valid = mask.bool()
    adv = advantages.detach()
    log_ratio = logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    tau = torch.full_like(ratio, tau_neg).masked_fill(adv > 0, tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = _finish(-gate * adv, valid, agg, const_norm, is_weights)
    return loss, _ratio_metrics(log_ratio, valid, torch.zeros_like(valid))


@POLICY_LOSSES.register("gmpo", "GMPO: geometric mean of clipped token ratios per sequence (Zhao et al. 2025); "
                        "clip bounds in log space, the paper's --rl.clip_low 0.4 --rl.clip_high 0.4")
def gmpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.4, clip_high: float = 0.4, dual_clip: float | None = None,
              agg: str = "seq-mean-token-mean", const_norm: float | None = None,
              is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673, eq. 4).

    With ``A_i`` the mean of the sequence's token advantages, ``sgn = sign(A_i)`` and ``d_t = log(pi_t /
    pi_old_t)``: ``c_t = sgn * min(sgn d_t, sgn clip(d_t, -clip_low, clip_high))`` (the pessimistic side, as
    PPO's min, token by token in log space), ``l_i = -A_i exp((1/|y_i|) sum_t c_t)``: the geometric mean of the
    clipped token ratios times the advantage, ``(prod_t min(r_t A_i, clip(r_t, e^-clip_low, e^clip_high) A_i))^(1
    /|y_i|)`` up to the sign. The geometric mean is less swayed by one outlier token than the arithmetic mean, so
    the clip range can be wider: the paper uses ``(e^-0.4, e^0.4)`` and averages per sequence
    (``agg="seq-mean-token-mean"``). ``clip_frac`` counts tokens whose log ratio was clipped.
    """
    _refuse_dual_clip("gmpo", dual_clip)
    valid = mask.bool()
    zeros = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - old_logp.detach(), zeros)
    adv_seq = _seq_mean(advantages.detach(), valid)
    sgn = torch.sign(adv_seq)[:, None]
    bounded = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sgn * torch.minimum(sgn * log_ratio, sgn * bounded)
    seq_loss = -adv_seq * torch.exp(_seq_mean(pessimistic, valid))
    loss = _finish(seq_loss[:, None].expand_as(logp), valid, agg, const_norm, is_weights)
    metrics = _ratio_metrics(log_ratio, valid, (pessimistic != log_ratio) & valid)
    return loss, metrics
