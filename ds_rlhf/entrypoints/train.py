"""The training commands: SFT (step 1), reward model (step 2), RL (step 3), and DPO (steps 2 and 3 in one).

`main_sft`, `main_rm`, `main_ppo` and `main_dpo` back the console scripts (`ds-rlhf-train-sft`,
`ds-rlhf train-sft`, ...) and the `launch/train_*.py` scripts that `deepspeed` and `accelerate launch` run. Each
prints its `*_DOC` plus the settings its trainer reads, with its defaults, on --help (without importing the
trainer), else parses those settings and trains.
"""

from __future__ import annotations

from ds_rlhf.cli import run_entry
from ds_rlhf.recipes.dpo import DPOTask
from ds_rlhf.recipes.rl import RLTrainer
from ds_rlhf.recipes.rm import RewardModelTask
from ds_rlhf.recipes.sft import SFTTask
from ds_rlhf.recipes.supervised import SupervisedTrainer

SFT_DOC = """Supervised fine-tuning (step 1): next-token loss on assistant tokens of an `sft` store, packed batches.

Examples:
  python launch/train_sft.py --data.train runs/data/sft --run.steps 200
  ds-rlhf train-sft --data.train runs/data/sft --run.steps 200          (the same, as the installed command)
  deepspeed --num_gpus 8 launch/train_sft.py --ds_config ds_configs/zero3.json --model.path /models/base \\
      --data.train /data/sft_store --data.micro_batch_tokens 16384
The export (run_dir/export) is the actor for train_rm.py and train_ppo.py.
"""

RM_DOC = """Reward-model training (step 2): Bradley-Terry loss on a `preference` store of chosen/rejected pairs.

Examples:
  python launch/train_rm.py --model.path runs/sft/export --data.train runs/data/preferences
  ds-rlhf train-rm --model.path runs/sft/export --data.train runs/data/preferences   (the installed command)
  deepspeed --num_gpus 8 launch/train_rm.py --ds_config ds_configs/zero3.json --model.path runs/sft/export \\
      --data.train /data/hh_rlhf_store
The export (run_dir/export) is train_ppo.py's --reward.model and the critic's initialisation.
"""

DPO_DOC = """Direct preference optimisation of the policy on a `preference` store: no reward model, no rollouts.

The loss is --dpo.loss (sigmoid: DPO; ipo: IPO) on the policy's log-ratios against the starting model (a frozen
copy, or with --model.lora_rank the base with the adapters disabled); --dpo.label_smoothing is cDPO,
--dpo.length_norm true averages log-probs per token, --dpo.reference false with --dpo.length_norm true and
--dpo.margin is SimPO. docs/DPO.md says which to pick.

Examples:
  python launch/train_dpo.py --model.path runs/sft/export --data.train runs/data/preferences
  ds-rlhf train-dpo --model.path runs/sft/export --data.train runs/data/preferences --dpo.beta 0.1
  deepspeed --num_gpus 8 launch/train_dpo.py --ds_config ds_configs/zero3.json --model.path runs/sft/export \\
      --data.train /data/hh_rlhf_store --dpo.precompute_ref true
The export (run_dir/export) is a causal LM: train_ppo.py's --model.path, or the model to serve.
"""

PPO_DOC = """Train a policy with RL (PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++) on a prompt store, rollouts from vLLM.

Examples:
  python launch/train_ppo.py --data.train runs/data/prompts --reward.fn gsm8k
  ds-rlhf train-ppo --data.train runs/data/prompts --reward.fn gsm8k          (the same, as the installed command)
  deepspeed --num_gpus 8 launch/train_ppo.py --ds_config ds_configs/zero3.json --model.path /models/qwen2-7b \\
      --data.train /data/gsm8k_prompts --rl.algo grpo --reward.fn gsm8k
"""

SFT_DEFAULTS = {"optim": {"lr": 1e-5}, "run": {"output_dir": "runs/sft", "steps": 0, "epochs": 1},
                "data": {"eval_fraction": 0.05}}
RM_DEFAULTS = {"optim": {"lr": 1e-5}, "run": {"output_dir": "runs/rm", "steps": 0, "epochs": 1},
               "data": {"eval_fraction": 0.1}}
DPO_DEFAULTS = {"optim": {"lr": 5e-7}, "run": {"output_dir": "runs/dpo", "steps": 0, "epochs": 1},
                "data": {"eval_fraction": 0.1}}
PPO_DEFAULTS = {"rl": {"algo": "grpo"}, "run": {"output_dir": "runs/ppo"}}


def run_sft(cfg):
    return SupervisedTrainer(cfg, SFTTask()).train()


def run_rm(cfg):
    return SupervisedTrainer(cfg, RewardModelTask(margin=cfg.optim.rm_margin)).train()


def run_dpo(cfg):
    return SupervisedTrainer(cfg, DPOTask(cfg.dpo)).train()


def run_ppo(cfg):
    return RLTrainer(cfg).train()


# The trainers' summaries are not exit codes: the mains return None (exit 0) and leave the summary to the logs.
def main_sft(argv: list[str] | None = None) -> None:
    run_entry(SFT_DOC, SFT_DEFAULTS, run_sft, argv, recipe="train-sft")


def main_rm(argv: list[str] | None = None) -> None:
    run_entry(RM_DOC, RM_DEFAULTS, run_rm, argv, recipe="train-rm")


def main_dpo(argv: list[str] | None = None) -> None:
    run_entry(DPO_DOC, DPO_DEFAULTS, run_dpo, argv, recipe="train-dpo")


def main_ppo(argv: list[str] | None = None) -> None:
    run_entry(PPO_DOC, PPO_DEFAULTS, run_ppo, argv, recipe="train-ppo")
