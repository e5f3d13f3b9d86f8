"""Supervised fine-tuning (step 1): `python launch/train_sft.py --help` for the options and examples.

A runnable script on purpose: `deepspeed launch/train_sft.py ...` and `accelerate launch launch/train_sft.py ...`
run this file on every rank. The command itself is `ds_rlhf.entrypoints.train.main_sft`, also installed as
`ds-rlhf-train-sft` and `ds-rlhf train-sft`.
"""

from ds_rlhf.entrypoints.train import main_sft

if __name__ == "__main__":
    main_sft()
