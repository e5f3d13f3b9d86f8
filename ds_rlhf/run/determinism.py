"""Deterministic mode (`run.deterministic true`): two runs of the same command on the same machine give the same
metrics and weights, bit for bit.

`configure_determinism(cfg)` runs once at the start of `setup_run`, before the process group, CUDA or vLLM start:
- torch: `use_deterministic_algorithms(True)` (an op without a deterministic kernel raises instead of warning),
  `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS's deterministic workspace, read when CUDA starts), cuDNN deterministic
  with autotuning (`benchmark`) off. Python, numpy and torch are seeded from `run.seed` by `seed_everything` as in
  every run.
- vLLM: `VLLM_BATCH_INVARIANT=1` on CUDA machines (vLLM's batch-invariant kernels: a request's logits do not depend
  on what else is in the batch), unless the environment sets it. vLLM's CPU platform has no batch-invariant kernels,
  so CPU runs leave it unset.
- Rollouts: `rollout.seeding request`, so prompt i's sample j of step s is drawn with its own seed, a function of
  (run.seed, s, rank, i, j) (`recipes/rl_service.sampling_spec`, `SamplingSpec.request_seed`), whatever order
  the engine schedules the requests in.
- Settings whose order depends on timing are turned off, each with a one-line note: `rollout.async_generation`
  (which weights a batch is generated with depends on how far training got) and `rollout.overlap_sync` (the engine
  loads the weights while the trainer goes on).
"""

from __future__ import annotations

import os

import torch

from ds_rlhf.config import Config

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
# (section, key, value in deterministic mode, why): settings set to that value, with a note when they held another
FORCED = (
    ("rollout", "seeding", "request", "a seed per request, so samples do not depend on the engine's scheduling"),
    ("rollout", "async_generation", False, "the weights a batch is generated with would depend on timing"),
    ("rollout", "overlap_sync", False, "the engine's weight load would overlap training"),
)


def forced_settings(cfg: Config) -> list[str]:
    """Set the FORCED settings on `cfg` (deterministic mode); returns a one-line note per changed setting."""
    notes = []
    for section, key, value, why in FORCED:
        target = getattr(cfg, section)
        if getattr(target, key) != value:
            notes.append(f"[deterministic] {section}.{key}={getattr(target, key)!r} -> {value!r}: {why}")
            setattr(target, key, value)
    return notes


def configure_determinism(cfg: Config) -> list[str]:
    """Apply `run.deterministic` (see the module docstring): a no-op when it is off. Returns the notes, printed on
    rank 0 (the process group does not exist yet: the launcher's RANK says which process is rank 0)."""
    if not cfg.run.deterministic:
        return []
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    if torch.cuda.is_available():
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    torch.use_deterministic_algorithms(True, warn_only=False)
    # torch would also fill every torch.empty with NaN; DeepSpeed's flat buffers (hundreds of MiB) made a tiny CPU
    # step 15x slower with it, and code reading memory it did not write is a bug the mode does not hide
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    notes = forced_settings(cfg)
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(note, flush=True)
    return notes
