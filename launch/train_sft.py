"""Supervised fine-tuning (step 1): next-token loss on assistant tokens of an `sft` store, packed batches.

Examples:
  python launch/train_sft.py --data.train runs/data/sft --run.steps 200
  deepspeed --num_gpus 8 launch/train_sft.py --ds_config ds_configs/zero3.json --model.path /models/base \\
      --data.train /data/sft_store --data.micro_batch_tokens 16384
The export (run_dir/export) is the actor for train_rm.py and train_ppo.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout

from ds_rlhf.cli import run_entry  # noqa: E402

DEFAULTS = {"optim": {"lr": 1e-5}, "run": {"output_dir": "runs/sft", "steps": 0, "epochs": 1},
            "data": {"eval_fraction": 0.05}}


def run(cfg):
    from ds_rlhf.trainer.sft import SFTTask
    from ds_rlhf.trainer.supervised import SupervisedTrainer

    return SupervisedTrainer(cfg, SFTTask()).train()


if __name__ == "__main__":
    run_entry(__doc__, DEFAULTS, run)
