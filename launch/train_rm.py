"""Reward-model training (step 2): `python launch/train_rm.py --help` for the options and examples.

A runnable script on purpose: `deepspeed launch/train_rm.py ...` and `accelerate launch launch/train_rm.py ...`
run this file on every rank. The command itself is `ds_rlhf.entrypoints.train.main_rm`, also installed as
`ds-rlhf-train-rm` and `ds-rlhf train-rm`.
"""

from ds_rlhf.entrypoints.train import main_rm

if __name__ == "__main__":
    main_rm()
