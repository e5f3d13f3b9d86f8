"""ds_rlhf: a DeepSpeed-native RLHF pipeline (SFT -> reward model -> PPO/GRPO) with vLLM rollouts."""

__version__ = "0.1.0"
