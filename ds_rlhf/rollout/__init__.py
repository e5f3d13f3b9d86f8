"""Rollouts (vLLM colocated / disaggregated, HF fallback) and the DeepSpeed -> rollout weight sync.

Importing this package does not import vLLM or DeepSpeed; the engines import them when built.
"""

from ds_rlhf.rollout.base import RolloutEngine, RolloutError, RolloutSample, SamplingSpec, TensorMeta
from ds_rlhf.rollout.factory import make_rollout_engine, resolve_backend
from ds_rlhf.rollout.weights.canary import SyncCanary, SyncCanaryError, default_threshold
from ds_rlhf.rollout.weights.gather import iter_weight_buckets
from ds_rlhf.rollout.weights.sync import WeightSync

__all__ = [
    "RolloutEngine", "RolloutError", "RolloutSample", "SamplingSpec", "SyncCanary", "SyncCanaryError", "TensorMeta",
    "WeightSync", "default_threshold", "iter_weight_buckets", "make_rollout_engine", "resolve_backend",
]
