"""RL algorithm core: advantage estimators, KL estimators and controllers, losses (PPO's in `losses`, the other
policy losses in `policy_losses`), rollout/trainer mismatch correction, memory-lean log-probs, direct preference
losses (DPO, IPO: `preference`). Pure functions on tensors: no I/O, no torch.distributed. Every algorithmic choice
is registered once in `registry` (name -> function + one-line doc); config choices and --help read it."""

from ds_rlhf.algos.advantages import (
    GROUP_MODES,
    broadcast_to_tokens,
    broadcast_to_tokens_packed,
    compute_advantages,
    estimator_inputs,
    gae,
    gae_packed,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    token_rewards_from_scores,
)
from ds_rlhf.algos.cu_seqlens import packed_to_padded, padded_to_packed
from ds_rlhf.algos.kl import KL_KINDS, AdaptiveKLController, FixedKLController, kl_penalty
from ds_rlhf.algos.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
    naive_token_logprobs,
    token_logprobs_from_hidden,
)
from ds_rlhf.algos.losses import (
    AGG_MODES,
    aggregate,
    entropy_bonus,
    kl_loss,
    masked_token_mean,
    policy_loss,
    value_loss,
)
from ds_rlhf.algos.mismatch import IS_MODES, mismatch_metrics, truncated_is_weights
from ds_rlhf.algos.policy_losses import cispo_loss, gmpo_loss, gspo_loss, gspo_token_loss, sapo_loss
from ds_rlhf.algos.preference import ipo_loss, log_ratios, preference_loss, sigmoid_loss
from ds_rlhf.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    DPO_LOSSES,
    KL_ESTIMATORS,
    MISMATCH_MODES,
    POLICY_LOSSES,
    Registry,
)
from ds_rlhf.algos.shaping import group_spread, informative_groups, overlong_penalty, truncated_rows

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "AGG_MODES", "AdaptiveKLController", "DPO_LOSSES", "FixedKLController",
    "GROUP_MODES", "IS_MODES", "KL_ESTIMATORS", "KL_KINDS", "MISMATCH_MODES", "POLICY_LOSSES", "Registry",
    "aggregate", "broadcast_to_tokens", "broadcast_to_tokens_packed", "cispo_loss", "compute_advantages",
    "entropy_bonus", "entropy_from_logits", "estimator_inputs", "gae", "gae_packed", "gmpo_loss", "group_advantages",
    "group_spread", "gspo_loss", "gspo_token_loss", "informative_groups", "ipo_loss", "kl_loss", "kl_penalty",
    "log_ratios", "logprobs_from_logits", "masked_token_mean", "masked_whiten", "mismatch_metrics",
    "naive_token_logprobs", "overlong_penalty", "packed_to_padded", "padded_to_packed", "policy_loss",
    "preference_loss", "reinforce_pp_advantages", "reinforce_pp_returns", "sapo_loss", "sigmoid_loss",
    "token_logprobs_from_hidden", "token_rewards_from_scores", "truncated_is_weights", "truncated_rows", "value_loss",
]
