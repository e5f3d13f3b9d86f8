"""DPO training (preference pairs -> policy, instead of RM + RL): `python launch/train_dpo.py --help` for the
options and examples.

A runnable script on purpose: `deepspeed launch/train_dpo.py ...` and `accelerate launch launch/train_dpo.py ...`
run this file on every rank. The command itself is `ds_rlhf.entrypoints.train.main_dpo`, also installed as
`ds-rlhf-train-dpo` and `ds-rlhf train-dpo`.
"""

from ds_rlhf.entrypoints.train import main_dpo

if __name__ == "__main__":
    main_dpo()
