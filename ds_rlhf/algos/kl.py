"""KL estimators between the policy and a reference policy, and the KL-coefficient controllers.

The per-token estimators take log-probabilities of the *sampled* tokens under both policies. With tokens
sampled from the policy, ``E[k1] = E[k3] = KL(pi || pi_ref)`` exactly and ``E[k2]`` matches it to second order.
They serve either as a per-token reward penalty (detached; see ``advantages.token_rewards_from_scores``) or as a
loss term (``losses.kl_loss``, differentiable).
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.registry import KL_ESTIMATORS

KL_ESTIMATORS.register("k1", "log(pi/ref): unbiased, can be negative")(lambda d: d)
KL_ESTIMATORS.register("k2", "log(pi/ref)^2 / 2: low variance, biased")(lambda d: 0.5 * d.square())
KL_ESTIMATORS.register("k3", "ref/pi - 1 - log(ref/pi): unbiased and >= 0 (Schulman 2020)")(
    lambda d: torch.expm1(-d) + d)
KL_KINDS = KL_ESTIMATORS.names()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3",
               max_log_ratio: float | None = None) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs. With ``d = logp - ref_logp = log(pi / pi_ref)``:

    ``k1 = d`` (unbiased, can be negative), ``k2 = d^2 / 2`` (low variance, biased),
    ``k3 = exp(-d) - 1 + d`` (unbiased and always >= 0). Schulman 2020, "Approximating KL Divergence"
    (joschu.net/blog/kl-approx.html). ``max_log_ratio`` optionally clamps ``d`` to ``[-m, m]`` first, which keeps
    ``k3`` finite when the policies drift far apart (at the cost of zero gradient beyond the clamp).
    """
    estimator = KL_ESTIMATORS.get(kind).fn
    log_ratio = logp - ref_logp
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return estimator(log_ratio)


class FixedKLController:
    """Constant KL coefficient ``beta``; ``update`` is a no-op (kept so the trainer treats both kinds alike)."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target``.

    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2 (``K_beta = n / horizon``).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be positive")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
