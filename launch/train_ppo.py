"""Train a policy with RL (PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++) on a prompt store, rollouts from vLLM.

Examples:
  python launch/train_ppo.py --data.train runs/data/prompts --rl.reward_fn gsm8k
  deepspeed --num_gpus 8 launch/train_ppo.py --ds_config ds_configs/zero3.json --model.path /models/qwen2-7b \\
      --data.train /data/gsm8k_prompts --rl.algo grpo --rl.reward_fn gsm8k
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from ds_rlhf.cli import run_entry  # noqa: E402

DEFAULTS = {"rl": {"algo": "grpo"}, "run": {"output_dir": "runs/ppo"}}


def run(cfg):
    from ds_rlhf.trainer.rl_trainer import RLTrainer

    return RLTrainer(cfg).train()


if __name__ == "__main__":
    run_entry(__doc__, DEFAULTS, run)
