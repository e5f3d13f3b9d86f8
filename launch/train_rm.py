"""Reward-model training (step 2): Bradley-Terry loss on a `preference` store of chosen/rejected pairs.

Examples:
  python launch/train_rm.py --model.path runs/sft/export --data.train runs/data/preferences
  deepspeed --num_gpus 8 launch/train_rm.py --ds_config ds_configs/zero3.json --model.path runs/sft/export \\
      --data.train /data/hh_rlhf_store
The export (run_dir/export) is train_ppo.py's --rl.reward_model and the critic's initialisation.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from ds_rlhf.cli import run_entry  # noqa: E402

DEFAULTS = {"optim": {"lr": 1e-5}, "run": {"output_dir": "runs/rm", "steps": 0, "epochs": 1},
            "data": {"eval_fraction": 0.1}}


def run(cfg):
    from ds_rlhf.trainer.rm import RewardModelTask
    from ds_rlhf.trainer.supervised import SupervisedTrainer

    return SupervisedTrainer(cfg, RewardModelTask(margin=cfg.optim.rm_margin)).train()


if __name__ == "__main__":
    run_entry(__doc__, DEFAULTS, run)
