"""Advantage estimators: GAE (PPO), GRPO / Dr.GRPO / RLOO group baselines, REINFORCE++ (and -baseline).

Layouts. Padded tensors are ``[B, T]`` with a response ``mask`` (1 = action token). The mask may be ragged,
left- or right-padded, or have gaps (e.g. tool output between turns): recursions run over the *valid* tokens
of each row only, so a masked position neither receives an advantage nor breaks the chain between the valid
tokens around it. Packed variants take 1-D tensors and ``cu_seqlens`` (see ``packing.py``) and return 1-D.

Sequences in a GRPO/RLOO batch are grouped contiguously: rows ``[g * G, (g + 1) * G)`` answer prompt ``g``.

All estimators run under ``no_grad``: advantages and returns are targets, never differentiated through.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.cu_seqlens import packed_to_padded, padded_to_packed
from ds_rlhf.algos.registry import ADVANTAGE_ESTIMATORS

GROUP_MODES = ("grpo", "grpo_batch_std", "grpo_no_std", "rloo")
SCALE_REWARDS = {"group": "grpo", "batch": "grpo_batch_std", "none": "grpo_no_std"}  # rl.scale_rewards -> mode


def _float(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _reverse_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE recursion over the valid tokens of each row; ``values=0, lam=1`` gives discounted returns."""
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    valid = mask.bool()
    rewards, values = torch.where(valid, rewards.to(dtype), 0.0), values.to(dtype)
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    out = []
    for t in range(length - 1, -1, -1):
        m = valid[:, t]
        value_t = torch.where(m, values[:, t], 0.0)
        adv_t = rewards[:, t] + gamma * next_value - value_t + gamma * lam * next_adv
        next_adv = torch.where(m, adv_t, next_adv)
        next_value = torch.where(m, value_t, next_value)
        out.append(torch.where(m, adv_t, 0.0))
    out.reverse()
    return torch.stack(out, dim=1) if out else rewards.clone()


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised Advantage Estimation over ``[B, T]``; returns ``(advantages, returns)``, zero where masked.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` (``t'`` = next valid token, ``V = 0`` after the last one),
    ``A_t = delta_t + gamma * lam * A_{t'}``, ``R_t = A_t + V_t`` (the critic's regression target).
    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16.
    For a multi-turn episode ``mask`` is its action mask: the steps are its generated tokens only, so the last
    token before an observation bootstraps from the value of the first generated token after it, gamma and lam
    apply once per generated token, and the observation tokens' rewards and values are never read.
    """
    adv = _reverse_scan(rewards, values, mask, gamma, lam)
    valid = mask.bool()
    returns = torch.where(valid, adv + _float(values).to(adv.dtype), 0.0)
    return adv, returns


@torch.no_grad()
def gae_packed(rewards, values, cu_seqlens, gamma: float, lam: float, mask: torch.Tensor | None = None):
    """``gae`` on packed 1-D ``rewards``/``values`` (``N`` tokens, boundaries ``cu_seqlens``); optional 1-D ``mask``."""
    r_pad, valid = packed_to_padded(rewards, cu_seqlens)
    v_pad, _ = packed_to_padded(values, cu_seqlens)
    if mask is not None:
        valid = valid & packed_to_padded(mask.bool(), cu_seqlens)[0]
    adv, ret = gae(r_pad, v_pad, valid, gamma, lam)
    return padded_to_packed(adv, cu_seqlens), padded_to_packed(ret, cu_seqlens)


def _group_index(batch: int, group_size: int | None, group_ids: torch.Tensor | None, device) -> torch.Tensor:
    """Group id per row: ``group_ids`` as given (any order, ragged sizes) or contiguous blocks of ``group_size``."""
    if group_ids is not None:
        if group_ids.shape != (batch,):
            raise ValueError(f"group_ids must have shape ({batch},), got {tuple(group_ids.shape)}")
        return group_ids.to(device)
    if group_size is None or group_size < 1 or batch % group_size:
        raise ValueError(f"need group_ids, or {batch} rows to be a multiple of group_size={group_size}")
    return torch.arange(batch, device=device) // group_size


def _group_moments(x: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size, by scatter-add over the group ids."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    n = counts.to(x.dtype)
    mean = torch.zeros_like(n).index_add_(0, inverse, x) / n
    sq_dev = torch.zeros_like(n).index_add_(0, inverse, (x - mean[inverse]).square())
    std = (sq_dev / (n - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], n[inverse]


@torch.no_grad()
def group_advantages(scores: torch.Tensor, group_size: int | None = None, mode: str = "grpo", eps: float = 1e-6,
                     group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level advantages ``[B]`` from scalar scores ``[B]`` with a per-prompt group baseline.

    - ``grpo``: ``(s_i - mean_g) / (std_g + eps)`` (unbiased std); Shao et al. 2024, DeepSeekMath, sec. 4.1.2.
    - ``grpo_batch_std``: ``(s_i - mean_g) / (std_batch + eps)``, the group's mean and the standard deviation of
      every score in the batch (unbiased): a group whose scores barely differ (a small format credit) keeps
      advantages of its own size instead of being scaled up to a correct-vs-wrong group's. Liu et al. 2025,
      "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning" (Lite PPO: group mean, batch std).
    - ``grpo_no_std`` (Dr.GRPO): ``s_i - mean_g``; Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3.
      Dr.GRPO's other half, no per-response length normalisation, is the loss aggregation
      ``seq-mean-token-sum-norm`` in ``losses.aggregate``.
    - ``rloo``: ``s_i - mean_{j != i} s_j = G / (G - 1) * (s_i - mean_g)``; Ahmadian et al. 2024, "Back to
      Basics", eq. 4 (after Kool et al. 2019).
    Groups are contiguous blocks of ``group_size`` rows, or given by ``group_ids[B]`` (ragged, any order; for
    groups that lost samples). A group of one has no baseline and gets advantage 0.
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"mode must be one of {GROUP_MODES}, got {mode!r}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    x = _float(scores)
    groups = _group_index(x.numel(), group_size, group_ids, x.device)
    if x.numel() == 0:
        return x.clone()
    mean, std, n = _group_moments(x, groups)
    centred = x - mean
    if mode == "grpo":
        centred = centred / (std + eps)
    elif mode == "grpo_batch_std":
        centred = centred / (x.std(unbiased=x.numel() > 1) + eps)
    elif mode == "rloo":
        centred = centred * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, centred, 0.0)


def broadcast_to_tokens(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``A_{i,t} = A_i * mask_{i,t}``: every action token of sequence ``i`` gets its sequence advantage."""
    return seq_adv[:, None] * mask.to(seq_adv.dtype)


def broadcast_to_tokens_packed(seq_adv: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None):
    """Packed ``broadcast_to_tokens``: token ``k`` of sequence ``i`` gets ``A_i`` (times the optional 1-D mask)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(seq_adv.device)
    out = torch.repeat_interleave(seq_adv, lengths)
    return out if mask is None else out * mask.to(out.dtype)


def token_rewards_from_scores(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                              kl_coef: float = 0.0) -> torch.Tensor:
    """Token rewards ``r_t = -beta * KL_t + score * [t = last valid token]`` (the RLHF reward shaping).

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2; Ouyang et al. 2022, eq. 2.
    """
    valid = mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, -1).max(dim=1).values
    rewards = torch.zeros(valid.shape, dtype=_float(scores).dtype, device=valid.device)
    has_tokens = last >= 0
    rows = torch.arange(valid.shape[0], device=valid.device)[has_tokens]
    rewards[rows, last[has_tokens]] = _float(scores)[has_tokens]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * torch.where(valid, kl.detach().to(rewards.dtype), 0.0)
    return rewards


@torch.no_grad()
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  mean: torch.Tensor | float | None = None, var: torch.Tensor | float | None = None) -> torch.Tensor:
    """Normalise over the valid entries: ``(x - mu) / sqrt(var + eps)`` (``+ mu`` again if not ``shift_mean``).

    ``mu``/``var`` default to the mean and unbiased variance over ``mask``; pass them in to normalise with
    statistics gathered over the global batch (all data-parallel ranks). Masked entries come back as 0.
    REINFORCE++'s "global batch normalisation": Hu 2025, arXiv:2501.03262, eq. 8.
    """
    valid = mask.bool()
    xf = _float(x)
    count = valid.sum()
    if mean is None:
        mean = torch.where(valid, xf, 0.0).sum() / count.clamp(min=1)
    if var is None:
        var = torch.where(valid, (xf - mean) ** 2, 0.0).sum() / (count - 1).clamp(min=1)
    out = (xf - mean) * torch.rsqrt(torch.as_tensor(var, dtype=xf.dtype, device=xf.device) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0)


@torch.no_grad()
def reinforce_pp_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t'}`` over the valid tokens (Williams 1992, REINFORCE)."""
    return _reverse_scan(token_rewards, torch.zeros_like(_float(token_rewards)), mask, gamma, 1.0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            baseline_scores: torch.Tensor | None = None, group_size: int | None = None,
                            eps: float = 1e-8, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ advantages: reward-to-go, then global batch normalisation over all valid tokens.

    Plain (``group_size=None``): ``A_t = whiten(G_t)``. Hu 2025, "REINFORCE++", arXiv:2501.03262, eqs. 7-8.
    ``-baseline`` (``group_size`` or ragged ``group_ids`` given): ``A_t = whiten(G_t - mean_g(b))``, ``b_i`` is
    ``baseline_scores[i]``
    (default: the sequence's full return ``G`` at its first valid token, i.e. its score when ``gamma = 1``);
    same paper, REINFORCE++-baseline (group mean baseline, then global-batch normalisation).
    """
    returns = reinforce_pp_returns(token_rewards, mask, gamma)
    if group_size is not None or group_ids is not None:
        valid = mask.bool()
        if baseline_scores is None:
            first = torch.where(valid, torch.arange(valid.shape[1], device=valid.device), valid.shape[1]).min(1).values
            baseline_scores = returns.gather(1, first.clamp(max=valid.shape[1] - 1)[:, None]).squeeze(1)
        b = _float(baseline_scores)
        group_mean, _, _ = _group_moments(b, _group_index(b.numel(), group_size, group_ids, b.device))
        returns = torch.where(valid, returns - group_mean[:, None].to(returns.dtype), 0.0)
    return masked_whiten(returns, mask, shift_mean=True, eps=eps)


def _unpack_inputs(inputs: dict, keys: tuple[str, ...]) -> torch.Tensor | None:
    """Packed call (``cu_seqlens`` given): pad the 1-D token tensors in ``keys`` in place and set ``mask`` to
    the ``[S, L]`` validity mask (and the optional 1-D loss mask). Returns ``cu_seqlens`` or None."""
    cu = inputs.pop("cu_seqlens", None)
    if cu is None:
        return None
    cu = cu.long()
    lengths = cu[1:] - cu[:-1]
    valid = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=cu.device) < lengths[:, None]
    token_mask = inputs.pop("mask", None)
    if token_mask is not None:
        valid = valid & packed_to_padded(token_mask.bool(), cu)[0]
    for key in keys:
        if inputs.get(key) is not None:
            inputs[key] = packed_to_padded(inputs[key], cu)[0]
    inputs["mask"] = valid
    return cu


@ADVANTAGE_ESTIMATORS.register("ppo", "GAE over critic values, advantages whitened (Schulman et al. 2016/2017)",
                               critic=True)
def _ppo(*, rewards, values, mask, gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = True):
    adv, returns = gae(rewards, values, mask, gamma, lam)
    return (masked_whiten(adv, mask) if whiten_advantages else adv), returns


def _group(mode: str):
    def estimator(*, scores, mask, group_size=None, group_ids=None, eps: float = 1e-6):
        seq_adv = group_advantages(scores, group_size, mode, eps, group_ids=group_ids)
        return broadcast_to_tokens(seq_adv, mask), None

    return estimator


@ADVANTAGE_ESTIMATORS.register("grpo", "(s - group mean) / std, the std per batch or group by rl.scale_rewards "
                               "(Shao et al. 2024; Liu et al. 2025)", groups=True)
def _grpo(*, scores, mask, group_size=None, group_ids=None, scale_rewards: str = "group", eps: float = 1e-6):
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {tuple(SCALE_REWARDS)}, got {scale_rewards!r}")
    return _group(SCALE_REWARDS[scale_rewards])(scores=scores, mask=mask, group_size=group_size,
                                                group_ids=group_ids, eps=eps)
ADVANTAGE_ESTIMATORS.register("dr_grpo", "Dr.GRPO: s - mean, no std (Liu et al. 2025); pair with loss_agg const-norm",
                              groups=True)(_group("grpo_no_std"))
ADVANTAGE_ESTIMATORS.register("rloo", "leave-one-out baseline s - mean of the others (Ahmadian et al. 2024)",
                              groups=True)(_group("rloo"))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp", "REINFORCE++: reward-to-go, global batch whitening (Hu 2025)")
def _reinforce_pp(*, token_rewards, mask, gamma: float = 1.0):
    return reinforce_pp_advantages(token_rewards, mask, gamma=gamma), None


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline", "REINFORCE++ with a per-prompt mean baseline (Hu 2025)",
                               groups=True)
def _reinforce_pp_baseline(*, token_rewards, mask, gamma: float = 1.0, group_size=None, group_ids=None,
                           baseline_scores=None):
    if group_size is None and group_ids is None:
        raise TypeError("reinforce_pp_baseline needs group_size or group_ids")
    return reinforce_pp_advantages(token_rewards, mask, gamma=gamma, group_size=group_size, group_ids=group_ids,
                                   baseline_scores=baseline_scores), None


def estimator_inputs(algo: str) -> tuple[str, ...]:
    """The keyword inputs the estimator registered as `algo` takes (the trainer passes exactly those)."""
    import inspect

    fn = ADVANTAGE_ESTIMATORS.get(algo).fn
    return tuple(inspect.signature(fn).parameters)


def compute_advantages(algo: str, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one entry point: ``(advantages, returns or None)`` from the estimator registered as ``algo``.

    Inputs by algo (padded ``[B, T]`` with ``mask``; or packed 1-D with ``cu_seqlens`` and optional 1-D ``mask``):
    - ``ppo``: ``rewards, values, gamma=1.0, lam=0.95, whiten_advantages=True`` -> GAE advantages, returns.
    - ``grpo`` / ``dr_grpo`` / ``rloo``: ``scores[B], group_size or group_ids, eps`` -> token-broadcast group
      advantages.
    - ``reinforce_pp``: ``token_rewards, gamma=1.0``; ``reinforce_pp_baseline``: also ``group_size or group_ids,
      baseline_scores=None``.
    Unknown ``algo`` is a ValueError listing the registered ones; an input the estimator does not take, a TypeError.
    """
    entry = ADVANTAGE_ESTIMATORS.get(algo)
    inputs = dict(inputs)
    cu = _unpack_inputs(inputs, ("rewards", "values", "token_rewards"))
    adv, returns = entry.fn(**inputs)
    if cu is not None:
        adv = padded_to_packed(adv, cu)
        returns = None if returns is None else padded_to_packed(returns, cu)
    return adv, returns
