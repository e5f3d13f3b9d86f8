"""Rewards: rule functions, user functions in several calling conventions, weighted sets, a timeout pool, and
the bad-reward policy. See scoring.py for what counts as a bad reward."""

from ds_rlhf.rewards.builtin import (
    BUILTIN_REWARDS,
    RewardFn,
    extract_final_number,
    format_reward,
    gsm8k_reward,
    math_verify_reward,
    shaped_math_reward,
)
from ds_rlhf.rewards.calling import detect_style
from ds_rlhf.rewards.loading import STYLES
from ds_rlhf.rewards.reward_set import RewardSet, RewardSpec, parse_weights
from ds_rlhf.rewards.reward_set import load_rewards as load_reward_fn
from ds_rlhf.rewards.scoring import BadRewardError, RewardReport, score_samples

__all__ = ["BUILTIN_REWARDS", "STYLES", "BadRewardError", "RewardFn", "RewardReport", "RewardSet", "RewardSpec",
           "detect_style", "extract_final_number", "format_reward", "gsm8k_reward", "load_reward_fn",
           "math_verify_reward", "parse_weights", "score_samples", "shaped_math_reward"]
