"""From scored experience to per-token advantages: KL-shaped token rewards, then the chosen estimator.

Thin glue over `ds_rlhf.algos` (which holds the formulas and their tests); what lives here is the mapping from
our Experience layout and the run's settings to those functions.
"""

from __future__ import annotations

import torch

from ds_rlhf.algos.advantages import (
    ALGOS,
    broadcast_to_tokens,
    gae,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    token_rewards_from_scores,
)
from ds_rlhf.algos.kl import kl_penalty
from ds_rlhf.config import RLConfig
from ds_rlhf.trainer.experience import Experience

GROUP_MODE = {"grpo": "grpo", "dr_grpo": "grpo_no_std", "rloo": "rloo"}


def token_rewards(exp: Experience, rl: RLConfig, kl_coef: float) -> torch.Tensor:
    """Sequence score on the last response token, minus the per-token KL penalty when KL is in the reward."""
    kl = None
    if rl.kl_in == "reward" and kl_coef > 0 and exp.ref_logp is not None:
        kl = kl_penalty(exp.old_logp_or_rollout(), exp.ref_logp, rl.kl_estimator)
    return token_rewards_from_scores(exp.scores, exp.action_mask, kl=kl, kl_coef=kl_coef)


def compute_advantages(exp: Experience, rl: RLConfig, kl_coef: float) -> None:
    """Fill exp.token_rewards, exp.advantages (and exp.returns for PPO) in place."""
    if rl.algo not in ALGOS:
        raise ValueError(f"unknown rl.algo '{rl.algo}': choose one of {', '.join(ALGOS)}")
    mask = exp.action_mask
    exp.token_rewards = token_rewards(exp, rl, kl_coef)
    if rl.algo == "ppo":
        if exp.values is None:
            raise ValueError("ppo needs critic values")
        exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, gamma=rl.gamma, lam=rl.lam)
        exp.advantages = masked_whiten(exp.advantages, mask) * mask
    elif rl.algo in GROUP_MODE:
        # KL-in-reward for group methods: fold the summed token penalty into the sequence score first.
        scores = (exp.token_rewards * mask).sum(dim=1)
        # group_ids, not a fixed group size: groups may have lost samples to the `drop` bad-reward policy.
        seq_adv = group_advantages(scores, mode=GROUP_MODE[rl.algo], group_ids=exp.group_ids)
        exp.advantages = broadcast_to_tokens(seq_adv, mask)
    else:
        baseline = rl.algo == "reinforce_pp_baseline"
        exp.advantages = reinforce_pp_advantages(
            exp.token_rewards, mask, gamma=rl.gamma,
            group_ids=exp.group_ids if baseline else None)
