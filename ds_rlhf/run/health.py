"""Health warnings over a run's recent metrics: a pure function of the history (a list of `metrics.jsonl`
records, oldest first), for the trainer loop to call after each step and for the run report to replay.

The newest record is compared with the running median of the `window` records before it:

- step time (`time/wall`, else `time/step`) more than `step_time_ratio` (1.2) x the median;
- throughput (`throughput/tokens_per_s`) below `throughput_ratio` (0.8) x the median;
- GPU utilisation (`sys/gpu_util_pct` or `gpu/util`) below `gpu_util_min` (70 %);
- no learning signal: in each of the last `no_signal_steps` (3) RL steps every prompt's samples got the same reward
  (`reward/frac_zero_std` = 1, else `reward/std` = 0), so every group-relative advantage is zero and the weights
  do not move, and no earlier step had a spread: the likely cause is the reward function (it never fires, the
  answer format or the reward key).

Two warnings name a policy collapse; each is raised once per run (`ONCE`: the trainer's monitor prints it once and
keeps it in `status.json`'s `health`; `replay` keeps its first step):

- `policy_collapse`: over the last `collapse_window` (10) steps the mean response length (`response/len_mean`) and
  the policy entropy (`actor/entropy`) both fell to at most `collapse_drop` (half) of their highest value while the
  reward (`reward/mean`) sat still (its last half-window within a tenth of the best sample reward seen,
  `reward/max`) at a low value (at most 0.3 of that best) and most groups' samples all scored the same (on average
  `COLLAPSE_EQUAL_GROUPS` of them over that half-window, `reward/frac_zero_std`): the policy shortens its answers to
  collect a fixed partial credit (e.g. the format's) instead of the right answers. Length and entropy also fall
  together in a healthy run as answers get short; there the groups keep telling answers apart (measured on the
  learning benchmark's runs, `docs/perf/raw/learn_arithmetic_scale_rewards_h100.json`);
- `flat_rewards`: in each of the last `collapse_steps` (5; `run.health_collapse_steps`) RL steps every prompt's
  samples got the same reward although an earlier step had a spread: zero advantages, the policy has settled on one
  answer per prompt and learns nothing from its samples.

One more, also once per run: `rollouts_trail`: the log-prob mismatch between the rollouts and the trainer
(`mismatch/kl_rollout_trainer`, k3 KL) at `TRAIL_KL` (0.02) or more in each of the last `TRAIL_STEPS` (3) steps.
Healthy runs of the learning benchmark stay at 0.0006-0.0026 synchronous and 0.0017-0.0073 async (one version
stale); a float32 trainer with bf16 engines passed 0.02 at step 7 and reached 0.078 at step 13
(`docs/perf/raw/learn_arithmetic_cap30_precision_h200.json`).

Each timing warning names its likely cause from the phase timers: the phase group that grew the most against its own
median (for a slowdown) or the largest non-training share of the step (for an idle GPU): rollout-bound,
training-bound (old log-probs, reference, critic, update), reward-bound, sync-bound, or waiting on data (the prompt
draw, `time/data`, plus the wall time outside every phase: host work between phases).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

PHASE_GROUPS = {
    "rollout": ("time/rollout",),
    "training": ("time/train", "time/old_logp", "time/reference", "time/critic"),
    "reward": ("time/reward",),
    "sync": ("time/sync",),
    "data": ("time/data",),
}
CAUSES = {
    "rollout": "rollout-bound: generation takes the time (longer responses, KV cache too small for one wave, "
               "or vLLM woken/slept every step)",
    "training": "training-bound: forward/backward/optimizer (micro-batches too small or too large, ZeRO "
                "communication, offload)",
    "reward": "reward-bound: reward functions or the reward model (slow user code, worker timeouts)",
    "sync": "sync-bound: the weight sync to the rollout engine (bucket size, ZeRO-3 gathers, interconnect)",
    "data": "waiting on data: time outside every phase (the prompt loader, storage reads, host work)",
}
GPU_UTIL_KEYS = ("sys/gpu_util_pct", "gpu/util", "gpu/util_pct")
ZERO_STD_KEY = "reward/frac_zero_std"  # share of prompt groups whose samples' rewards are all equal (RL)
# policy_collapse: the share of groups whose samples all scored the same, on average over the reward's last half-window
COLLAPSE_EQUAL_GROUPS = 0.75
NO_SIGNAL_CAUSE = ("no learning signal: the weights do not change; likely the reward function never fires (check "
                   "reward.fn), the responses miss the answer format it parses (see samples.jsonl: "
                   "--run.sample_log_every), or it reads the wrong key (ground_truth in the prompt store)")
COLLAPSE_TRY = ("try rl.scale_rewards batch (the default: `group` scales a partial credit's groups up to a right "
                "answer's) or none (Dr.GRPO), a lower optim.lr, or rl.entropy_coef > 0")
MISMATCH_KEY = "mismatch/kl_rollout_trainer"
TRAIL_KL, TRAIL_STEPS = 0.02, 3
TRAIL_CAUSE = ("the rollouts come from a policy other than the trainer's (the mismatch correction, rl.mismatch, "
               "only reweights them): a weight sync that did not apply, --model.dtype fp32 with bf16/fp16 engines "
               "(Adam steps under half a bf16 step do not reach them), FP8 rollouts, or rollout.max_staleness > 1")
ONCE = ("policy_collapse", "flat_rewards", "rollouts_trail")  # raised once per run


@dataclass(frozen=True)
class HealthWarning:
    kind: str  # step_time | throughput | gpu_util | no_signal | policy_collapse | flat_rewards
    step: int
    value: float
    baseline: float  # the running median (or the threshold, for gpu_util)
    cause: str  # a key of CAUSES, or "" when the phase timers are missing
    message: str


def _num(record: dict, key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def step_seconds(record: dict) -> float | None:
    wall = _num(record, "time/wall")
    return wall if wall is not None else _num(record, "time/step")


def phase_times(record: dict) -> dict[str, float]:
    """Seconds per phase group of one record; `data` is the prompt draw (`time/data`, when the loop times it) plus
    the wall time that no phase accounts for."""
    out = {}
    for group, keys in PHASE_GROUPS.items():
        values = [v for k in keys if (v := _num(record, k)) is not None]
        if values:
            out[group] = sum(values)
    wall = _num(record, "time/wall")
    if wall is not None and out:
        out["data"] = out.get("data", 0.0) + max(0.0, wall - sum(out.values()))
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def slowdown_cause(record: dict, history: list[dict]) -> str:
    """The phase group whose time grew the most (seconds) against its median over `history`."""
    now = phase_times(record)
    growth = {}
    for group, seconds in now.items():
        base = _median([t[group] for r in history if group in (t := phase_times(r))])
        growth[group] = seconds - (base if base is not None else seconds)
    if not growth:
        return ""
    group = max(growth, key=growth.get)
    return group if growth[group] > 0 else ""


def idle_cause(record: dict) -> str:
    """Why the GPU idles: the largest share of the step outside training; training itself when nothing else."""
    now = phase_times(record)
    if not now:
        return ""
    others = {g: t for g, t in now.items() if g != "training"}
    if others and max(others.values()) >= now.get("training", 0.0):
        return max(others, key=others.get)
    return "training"


def health_warnings(history: list[dict], *, window: int = 20, min_history: int = 5, step_time_ratio: float = 1.2,
                    throughput_ratio: float = 0.8, gpu_util_min: float = 70.0, no_signal_steps: int = 3,
                    collapse_window: int = 10, collapse_drop: float = 0.5,
                    collapse_steps: int = 5) -> list[HealthWarning]:
    """Warnings for the newest record of `history` (the timing ones empty with fewer than `min_history` earlier
    records, so the first, slower steps (compilation, warm-up) set no baseline; the no-signal one empty once any
    record of `history` had a reward spread: then `flat_rewards` speaks)."""
    if not history:
        return []
    last, before = history[-1], history[-1 - window:-1] if window else history[:-1]
    step = int(last.get("step", len(history)))
    out = []
    if len(before) >= min_history:
        out += _slow_step(last, before, step, step_time_ratio) + _low_throughput(last, before, step, throughput_ratio)
    out += _idle_gpu(last, step, gpu_util_min)
    spread_seen = any(zero_spread(r) is False for r in history)
    out += [] if spread_seen else _no_signal(history[-no_signal_steps:] if no_signal_steps > 0 else [], step,
                                             no_signal_steps)
    out += _policy_collapse(history, step, collapse_window, collapse_drop) + _rollouts_trail(history, step)
    return out + _flat_rewards(history, step, collapse_steps)


def zero_spread(record: dict) -> bool | None:
    """Whether every prompt group of the record's step had one reward for all its samples (None: no reward
    metrics, e.g. an SFT step): `reward/frac_zero_std` >= 1, else a batch-wide `reward/std` of 0."""
    frac = _num(record, ZERO_STD_KEY)
    if frac is not None:
        return frac >= 1.0
    std = _num(record, "reward/std")
    return None if std is None else std == 0.0


def _no_signal(last: list[dict], step: int, steps: int) -> list[HealthWarning]:
    if steps <= 0 or len(last) < steps or not all(zero_spread(r) for r in last):
        return []
    mean, std = _num(last[-1], "reward/mean"), _num(last[-1], "reward/std")
    same = f"; every reward {mean:.4g}" if std == 0.0 and mean is not None else ""
    text = (f"step {step}: {steps} steps in a row where each prompt's samples all got the same reward "
            f"({ZERO_STD_KEY} = 1{same}): {NO_SIGNAL_CAUSE}")
    return [HealthWarning("no_signal", step, 1.0, 1.0, "", text)]


def _policy_collapse(history: list[dict], step: int, window: int, drop: float) -> list[HealthWarning]:
    keys = ("response/len_mean", "actor/entropy", "reward/mean")
    recs = [r for r in history if all(_num(r, k) is not None for k in keys)][-window:] if window > 1 else []
    if len(recs) < window or recs[-1] is not history[-1]:
        return []
    lens, ents, rewards = ([_num(r, k) for r in recs] for k in keys)
    if lens[-1] > drop * max(lens) or ents[-1] > drop * max(ents):
        return []
    best = max([v for r in history if (v := _num(r, "reward/max")) is not None] + rewards)
    tail = rewards[-max(2, window // 2):]
    level = statistics.fmean(tail)
    if best <= 0 or max(tail) - min(tail) > 0.1 * best or level > 0.3 * best:
        return []
    equal = [v for r in recs[-len(tail):] if (v := _num(r, ZERO_STD_KEY)) is not None]
    if not equal or statistics.fmean(equal) < COLLAPSE_EQUAL_GROUPS:
        return []  # the groups still tell answers apart: a policy learning short answers, not one stuck on a credit
    text = (f"policy collapse suspected at step {step}: response length {max(lens):.0f}->{lens[-1]:.0f} tokens "
            f"and entropy {max(ents):.2g}->{ents[-1]:.2g} within the last {window} steps while the reward stays at "
            f"{level:.2f} (the best sample reward seen is {best:.2g}: a partial credit such as the format's, not "
            f"right answers); {COLLAPSE_TRY}")
    return [HealthWarning("policy_collapse", step, lens[-1], max(lens), "", text)]


def _flat_rewards(history: list[dict], step: int, steps: int) -> list[HealthWarning]:
    recs = [(r, flat) for r in history if (flat := zero_spread(r)) is not None]
    if steps <= 0 or len(recs) <= steps or recs[-1][0] is not history[-1]:
        return []
    if not all(flat for _, flat in recs[-steps:]):
        return []
    spread = [r for r, flat in recs[:-steps] if not flat]
    if not spread:
        return []  # never a spread: no_signal's case (the reward function)
    mean, std = _num(history[-1], "reward/mean"), _num(history[-1], "reward/std")
    same = f" (every reward {mean:.4g})" if std == 0.0 and mean is not None else ""
    text = (f"policy collapse at step {step}: in each of the last {steps} steps every prompt's samples got the "
            f"same reward{same} though step {spread[-1].get('step', '?')}'s still differed: zero advantages, the "
            f"policy gives one answer per prompt and learns nothing from it; {COLLAPSE_TRY}, or a higher "
            f"rollout.temperature")
    return [HealthWarning("flat_rewards", step, 1.0, 1.0, "", text)]


def _rollouts_trail(history: list[dict], step: int) -> list[HealthWarning]:
    recs = [r for r in history if _num(r, MISMATCH_KEY) is not None]
    if len(recs) < TRAIL_STEPS or recs[-1] is not history[-1]:
        return []
    last = [_num(r, MISMATCH_KEY) for r in recs[-TRAIL_STEPS:]]
    if min(last) < TRAIL_KL:
        return []
    text = (f"rollouts trail the trainer at step {step}: rollout/trainer log-prob mismatch ({MISMATCH_KEY}) "
            f"{last[-1]:.2g}, at least {TRAIL_KL} in each of the last {TRAIL_STEPS} steps (step "
            f"{recs[0].get('step', '?')}: {_num(recs[0], MISMATCH_KEY):.2g}; healthy runs stay under 0.008): "
            f"{TRAIL_CAUSE}")
    return [HealthWarning("rollouts_trail", step, last[-1], TRAIL_KL, "", text)]


def _slow_step(last: dict, before: list[dict], step: int, ratio: float) -> list[HealthWarning]:
    now, base = step_seconds(last), _median([s for r in before if (s := step_seconds(r)) is not None])
    if now is None or not base or now <= ratio * base:
        return []
    cause = slowdown_cause(last, before)
    text = f"step {step} took {now:.2f}s, {now / base:.2f}x the running median {base:.2f}s"
    return [HealthWarning("step_time", step, now, base, cause, _with_cause(text, cause))]


def _low_throughput(last: dict, before: list[dict], step: int, ratio: float) -> list[HealthWarning]:
    key = "throughput/tokens_per_s"
    now, base = _num(last, key), _median([v for r in before if (v := _num(r, key)) is not None])
    if now is None or not base or now >= ratio * base:
        return []
    cause = slowdown_cause(last, before)
    text = f"step {step}: {now:.0f} tokens/s, {now / base:.0%} of the running median {base:.0f}"
    return [HealthWarning("throughput", step, now, base, cause, _with_cause(text, cause))]


def _idle_gpu(last: dict, step: int, threshold: float) -> list[HealthWarning]:
    util = next((v for k in GPU_UTIL_KEYS if (v := _num(last, k)) is not None), None)
    if util is None or util >= threshold:
        return []
    cause = idle_cause(last)
    text = f"step {step}: GPU utilisation {util:.0f}% (< {threshold:.0f}%)"
    return [HealthWarning("gpu_util", step, util, threshold, cause, _with_cause(text, cause))]


def _with_cause(text: str, cause: str) -> str:
    return f"{text}; likely {CAUSES[cause]}" if cause else f"{text} (no phase timers to say why)"


def replay(history: list[dict], **kwargs) -> list[HealthWarning]:
    """Every warning the trainer would have raised step by step over a whole run (for the run report); a `ONCE`
    kind at its first step only."""
    out, seen = [], set()
    for i in range(len(history)):
        for w in health_warnings(history[: i + 1], **kwargs):
            if w.kind not in seen:
                out.append(w)
            if w.kind in ONCE:
                seen.add(w.kind)
    return out
