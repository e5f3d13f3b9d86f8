"""Direct preference losses on sequence log-probs: DPO, cDPO label smoothing, IPO, and the length-normalised
(SimPO-style) reward. Pure functions on per-pair tensors `[B]`.

Each pair has the policy's summed log-prob of the chosen and the rejected response (`logp_c`, `logp_r`), the
reference model's (`ref_c`, `ref_r`) and the response lengths in tokens (`n_c`, `n_r`). The implicit reward of a
response is

    r = beta * (logp - ref)                       (Rafailov et al. 2023, eq. 5)
    r = beta * (logp / n - ref / n)               with length_norm (per-token average; Meng et al. 2024 without ref)

and reference-free (`ref` taken as 0) the reward is SimPO's `beta / n * logp` with length_norm. With
h = (r_c - r_r) / beta, the difference of the two log-ratios:

    sigmoid  loss = -(1 - eps) log sigmoid(beta h - gamma) - eps log sigmoid(-(beta h - gamma))
             eps = label_smoothing (cDPO, Mitchell 2023; 0 is DPO, Rafailov et al. 2023, eq. 7);
             gamma = the target reward margin (SimPO, Meng et al. 2024, eq. 6; 0 is DPO)
    ipo      loss = (h - 1 / (2 beta))^2          (Azar et al. 2023, eq. 17: the log-ratio difference regressed
             onto 1 / (2 tau), tau = beta)

`DPO_LOSSES` (registry `dpo.loss`) maps each name to its function `fn(h, *, beta, label_smoothing, margin)` -> the
per-pair loss `[B]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_rlhf.algos.registry import DPO_LOSSES


def log_ratios(logp_c: torch.Tensor, logp_r: torch.Tensor, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
               n_c: torch.Tensor, n_r: torch.Tensor, *, length_norm: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, (log pi(y_c|x) - log ref(y_c|x), the same for y_r); without a reference (`ref_c`/`ref_r` None)
    the policy's log-probs alone. With `length_norm` each sequence log-prob is divided by its response length
    (`n`, at least 1): the per-token average."""
    ratio_c = logp_c if ref_c is None else logp_c - ref_c
    ratio_r = logp_r if ref_r is None else logp_r - ref_r
    if length_norm:
        ratio_c = ratio_c / n_c.clamp(min=1).to(ratio_c.dtype)
        ratio_r = ratio_r / n_r.clamp(min=1).to(ratio_r.dtype)
    return ratio_c, ratio_r


@DPO_LOSSES.register("sigmoid", "DPO: -log sigmoid(beta h - margin), h the log-ratio difference; with label_smoothing "
                                "eps, cDPO (Rafailov et al. 2023; Mitchell 2023)")
def sigmoid_loss(h: torch.Tensor, *, beta: float, label_smoothing: float = 0.0, margin: float = 0.0) -> torch.Tensor:
    """-(1 - eps) log sigmoid(beta h - margin) - eps log sigmoid(-(beta h - margin)), per pair."""
    z = beta * h - margin
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@DPO_LOSSES.register("ipo", "IPO: (h - 1/(2 beta))^2, a squared loss that keeps the log-ratio difference h finite "
                            "(Azar et al. 2023)")
def ipo_loss(h: torch.Tensor, *, beta: float, label_smoothing: float = 0.0, margin: float = 0.0) -> torch.Tensor:
    """(h - 1 / (2 beta))^2, per pair (label_smoothing and margin do not apply; the config refuses them)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


def preference_loss(loss: str, ratio_c: torch.Tensor, ratio_r: torch.Tensor, *, beta: float,
                    label_smoothing: float = 0.0, margin: float = 0.0) -> dict[str, torch.Tensor]:
    """The `dpo.loss` entry `loss` on log-ratios (`log_ratios`): per pair, `loss`, the implicit rewards
    `chosen` = beta * ratio_c and `rejected` = beta * ratio_r (detached), `margin` = chosen - rejected and `correct`
    (1 where chosen > rejected, 0.5 for a tie, else 0)."""
    h = ratio_c - ratio_r
    losses = DPO_LOSSES.get(loss).fn(h, beta=beta, label_smoothing=label_smoothing, margin=margin)
    chosen, rejected = (beta * ratio_c).detach(), (beta * ratio_r).detach()
    correct = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return {"loss": losses, "chosen": chosen, "rejected": rejected, "margin": chosen - rejected, "correct": correct}
