"""ds_rlhf: a DeepSpeed-native RLHF pipeline (SFT -> reward model -> PPO/GRPO) with vLLM rollouts.

`from ds_rlhf import RLTrainer` (and `SFTTrainer`, `RMTrainer`, `DPOTrainer`, `TrainResult`) loads the Python API,
`ds_rlhf/api.py`, on first use: importing the package itself stays light."""

import importlib

__version__ = "0.1.0"
_API = ("DPOTrainer", "RLTrainer", "RMTrainer", "SFTTrainer", "TrainResult")


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("ds_rlhf.api"), name)
    raise AttributeError(f"module 'ds_rlhf' has no attribute {name!r}")
