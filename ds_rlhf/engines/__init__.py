"""DeepSpeed engines for every model role (actor, critic, reference, reward), built from ds_config JSON files.

Modules (imported directly; this package imports nothing heavy on its own):
- ``ds_config``: load configs, resolve ``"auto"`` from the run's CLI, pick precision, save the resolved config;
- ``models``: ``load_causal_lm``, ``CriticModel`` (backbone + value head), ``RewardModel`` (last non-pad score);
- ``attention``: attention back-end selection (flash-attention 2 / torch varlen / SDPA), measured by
  ``bench/attention.py``;
- ``builder``: ``build_engine`` and ``build_actor/critic/reference/reward``;
- ``onebit_adam`` + ``compression``: 1-bit Adam with an error-compensated 1-bit all-reduce (ZeRO stage 0);
- ``hf_export``: Hugging Face export from any ZeRO stage (run checkpoints: ``ds_rlhf/run/checkpoint/``);
- ``memory``: per-role memory accounting.
"""
