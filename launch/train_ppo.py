"""RL training (step 3): `python launch/train_ppo.py --help` for the options and examples.

A runnable script on purpose: `deepspeed launch/train_ppo.py ...` and `accelerate launch launch/train_ppo.py ...`
run this file on every rank. The command itself is `ds_rlhf.entrypoints.train.main_ppo`, also installed as
`ds-rlhf-train-ppo` and `ds-rlhf train-ppo`.
"""

from ds_rlhf.entrypoints.train import main_ppo

if __name__ == "__main__":
    main_ppo()
