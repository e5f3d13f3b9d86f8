"""Re-export of ds_rlhf.rewards (the reward code lives there), so `from ds_rlhf.trainer.rewards import ...` works."""

from ds_rlhf.rewards import (  # noqa: F401
    BUILTIN_REWARDS,
    STYLES,
    BadRewardError,
    RewardFn,
    RewardReport,
    RewardSet,
    RewardSpec,
    detect_style,
    extract_final_number,
    format_reward,
    gsm8k_reward,
    load_reward_fn,
    math_verify_reward,
    parse_weights,
    score_samples,
    shaped_math_reward,
)
