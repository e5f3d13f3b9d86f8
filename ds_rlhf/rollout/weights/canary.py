"""Sync canary: prove after every weight sync that the rollout engine computes what the trainer computes.

Why: a sync that silently does nothing (weights packed into stale kernels, names that no loader matched, a skipped
call) leaves the rollout engine sampling from an old policy. Training then goes on with importance ratios that
quietly drift until they collapse, hours later. One forward over a short fixed probe on each side is cheap and
turns that into an immediate, explicit error.

The probe's per-token log-probs are scored by the trainer (a plain forward; under ZeRO-3 DeepSpeed gathers on the
fly, so *every trainer rank must call `check`*) and by the rollout engine (`score`, vLLM's `prompt_logprobs`).
The max abs difference is reduced (max) over ranks, so all ranks raise together instead of some hanging in the
next collective.

What is compared, and the default thresholds (override with `threshold=`, `rollout.canary_threshold` in a run), by
the rollout engine's weight dtype and the trainer's device:
- float32 on CPU: the max abs difference over the probe's tokens, 1e-3. vLLM-CPU vs HF after a sync agree to ~1e-6
  on the tiny model; before a sync, a few optimizer steps at lr 1e-3 move them by > 1e-2.
- float32 on CUDA: the max abs difference, 0.1. TF32 matmuls and vLLM's own kernels: SmolLM2-135M-Instruct on an
  H200 differed by 0.032 after its first sync (57-token probe, 2026-12-03).
- bfloat16 / float16: the *mean* abs difference over the probe's tokens, 0.5. bf16 rounding moves single tokens a lot
  on a trained model's peaked distributions: SmolLM2-135M-Instruct (GRPO at lr 2e-5, 57-token probe, H200,
  2026-12-03) differed after its syncs by a max of 0.24-0.96 over the first 28 and 1.57 at step 177, where the
  mean was 0.15. A max threshold stopped that healthy run; the mean over the probe is steady. On a random 0.5B model
  bf16 vLLM vs bf16 HF differ by a max of 0.125 after a sync and 2.90 before one (64-token probe). So in bf16 the
  canary catches weights not applied, mis-mapped, or a policy that has drifted well away, not one skipped small
  step; train in float32 for a sharp check.
- A float32 trainer with a bf16 / fp16 engine (`--model.dtype fp32 --rollout.dtype bf16`): the trainer's probe runs
  under autocast to the engine's dtype (`reference_autocast`), then judged as bf16.
The history records both figures (`max_abs_diff`, `mean_abs_diff`) and which one was judged (`statistic`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ds_rlhf.engines.models import unwrap

log = logging.getLogger(__name__)

DEFAULT_THRESHOLDS = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.5}
FLOAT32_CUDA_THRESHOLD = 0.1


class SyncCanaryError(RuntimeError):
    """The rollout engine's log-probs disagree with the trainer's after a sync: its weights are not the trainer's."""


def rollout_weight_dtype(rollout) -> torch.dtype | None:
    """The rollout engine's weight dtype (None: no engine on this rank, or one without a weight transport)."""
    return rollout.weights.dtype if rollout is not None and rollout.weights is not None else None


def statistic(dtype: torch.dtype | None) -> str:
    """What the check compares: "max" (abs difference over the probe's tokens) in float32, "mean" otherwise."""
    return "max" if dtype == torch.float32 else "mean"


def default_threshold(dtype: torch.dtype | None, device_type: str = "cpu") -> float:
    if dtype == torch.float32 and device_type == "cuda":
        return FLOAT32_CUDA_THRESHOLD
    return DEFAULT_THRESHOLDS.get(dtype, DEFAULT_THRESHOLDS[torch.bfloat16])


@torch.no_grad()
def trainer_logprobs(trainer_module, ids: Sequence[int], engine_dtype: torch.dtype | None = None) -> list[float]:
    """Log-prob of `ids[1:]` under the trainer model (a DeepSpeed engine or an HF causal LM), in float32.

    `engine_dtype` (the rollout engine's weight dtype): where it is bf16 / fp16 and the trainer's weights are
    float32, the forward runs under autocast to it, so its matmuls read the weights rounded as the engine holds them
    (`reference_autocast`)."""
    module = unwrap(trainer_module)
    first = next(iter(module.parameters()))
    was_training = module.training
    module.eval()
    try:
        x = torch.tensor([list(ids)], device=first.device)
        with torch.autocast(first.device.type, dtype=engine_dtype or torch.bfloat16,
                            enabled=reference_autocast(first.dtype, engine_dtype)):
            out = trainer_module(input_ids=x)
        logits = (out.logits if hasattr(out, "logits") else out[0])[0, :-1].float()
        lp = F.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).squeeze(-1)
    finally:
        module.train(was_training)
    return lp.cpu().tolist()


def reference_autocast(trainer_dtype: torch.dtype, engine_dtype: torch.dtype | None) -> bool:
    """Whether the trainer's probe runs under autocast to the engine's dtype: float32 trainer weights with a bf16 /
    fp16 engine. The engine holds each weight rounded; an Adam step smaller than half a bf16 step moves the float32
    weight but not its rounding, so steps that add up the same way move the float32 forward away from the engine's
    until they cross a rounding step (SmolLM2-135M at lr 2e-5: the probe's mean difference from 0.05 to 0.98 in 12
    steps, `docs/PERFORMANCE.md`). Under autocast the matmuls read the rounded weights and the two agree to the
    bf16 level (0.04-0.07) however far the weights drifted; a sync not applied still shows."""
    return trainer_dtype == torch.float32 and engine_dtype in (torch.bfloat16, torch.float16)


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class SyncCanary:
    """`check(trainer, rollout)` after each sync; raises SyncCanaryError when the max abs diff exceeds the threshold.

    `rollout` may be None on ranks without a rollout engine (disaggregated placement: only trainer rank 0 has one);
    those ranks still take part in the trainer forward and the cross-rank max.

    `start(trainer, rollout)` splits a check in two: the trainer's forward and the engine's scoring request now
    (not awaited where the engine runs elsewhere: `RolloutEngine.logprobs_replicas_later`), the comparison in the
    returned check's `finish()` (every rank, at the same point: the cross-rank max is collective).
    """

    def __init__(self, probe_ids: Sequence[int], threshold: float | None = None) -> None:
        if len(probe_ids) < 2:
            raise ValueError("the canary probe needs at least 2 tokens")
        self.probe_ids = list(probe_ids)
        self.threshold = threshold
        self.history: list[dict] = []

    def probe(self, trainer_module, engine_dtype: torch.dtype | None = None) -> tuple[list[float], float]:
        """The trainer's side alone: the probe's log-probs and the seconds they took (`engine_dtype`: see
        `trainer_logprobs`). `WeightSync` takes them before handing the weights over (same weights), while the GPU is
        not shared with the engines' loads."""
        t0 = time.perf_counter()
        return trainer_logprobs(trainer_module, self.probe_ids, engine_dtype), time.perf_counter() - t0

    def start(self, trainer_module, rollout, probe: tuple[list[float], float] | None = None) -> CanaryCheck:
        """The trainer's log-probs (`probe`'s, when given: see `probe`) and the engine's scoring request."""
        t0 = time.perf_counter()
        dtype = rollout_weight_dtype(rollout)
        ref, spent = probe if probe is not None else (trainer_logprobs(trainer_module, self.probe_ids, dtype), 0.0)
        replicas = rollout.logprobs_replicas_later([self.probe_ids]) if rollout is not None else None
        device_type = next(iter(unwrap(trainer_module).parameters())).device.type
        threshold = self.threshold if self.threshold is not None else default_threshold(dtype, device_type)
        return CanaryCheck(self, ref, replicas, threshold, spent + time.perf_counter() - t0, statistic(dtype))

    def measure(self, trainer_module, rollout) -> dict:
        return self.start(trainer_module, rollout).measure()

    def check(self, trainer_module, rollout) -> float:
        return self.start(trainer_module, rollout).finish()


class CanaryCheck:
    """One canary check under way (`SyncCanary.start`). `seconds` counts the trainer's own time in it: the
    forward and request, and the comparison (with the wait for the engine's scores, where not already read)."""

    def __init__(self, canary: SyncCanary, ref: list[float], replicas, threshold: float, seconds: float,
                 statistic: str = "max") -> None:
        self.canary, self.ref, self.replicas, self.threshold, self.seconds = canary, ref, replicas, threshold, seconds
        self.statistic = statistic

    def measure(self) -> dict:
        t0 = time.perf_counter()
        judged = "max_abs_diff" if self.statistic == "max" else "mean_abs_diff"
        worst = {"max_abs_diff": -math.inf, "mean_abs_diff": -math.inf}
        if self.replicas is not None:  # every replica (several sidecar engines): the worst one counts
            for replica in self.replicas.result():
                got = replica[0]
                diffs = [abs(a - b) for a, b in zip(self.ref, got)]
                if len(got) != len(self.ref) or any(math.isnan(d) for d in diffs):
                    worst = {"max_abs_diff": math.inf, "mean_abs_diff": math.inf}
                elif (figures := {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)})[judged] \
                        > worst[judged]:
                    worst = figures
        worst[judged] = _max_over_ranks(worst[judged])
        return {**worst, "statistic": self.statistic, "judged": worst[judged], "threshold": self.threshold,
                "seconds": self.seconds + time.perf_counter() - t0}

    def finish(self) -> float:
        """The judged difference (`statistic`); SyncCanaryError when it is over the threshold (in the history)."""
        info = self.measure()
        self.canary.history.append(info)
        diff, threshold = info["judged"], info["threshold"]
        log.info("sync canary: %s |logp_trainer - logp_rollout| = %.3g (threshold %.3g; max %.3g)", self.statistic,
                 diff, threshold, info["max_abs_diff"])
        if not diff <= threshold:
            raise SyncCanaryError(
                f"after the weight sync the rollout engine disagrees with the trainer on the probe sequence: "
                f"{self.statistic} abs log-prob difference {diff:.4g} > threshold {threshold:.4g} ({len(self.ref) + 1}"
                f" tokens; max {info['max_abs_diff']:.4g}, mean {info['mean_abs_diff']:.4g}). The rollout engine is "
                "not serving the trained weights (sync skipped, not applied, or names mis-mapped), so its rollouts "
                "would be off-policy; stopping instead of training on them. If the difference is only numerical "
                "noise, raise --rollout.canary_threshold, or train and roll out in fp32 (--model.dtype fp32 with "
                "--rollout.dtype auto or fp32).")
        return diff
