"""Numbers of an RL step that are not finite: they stop the run, or skip what they touch (`rl.on_nonfinite`).

Three checks, each agreed over the ranks so every rank takes the same path through the collectives:

- **reward** (and **advantage**): before the update (`check_inputs`), the trajectory's rewards and then its
  advantages and returns, in float32 (a reward of 1e300 is inf there);
- **loss**: each micro-batch's actor and critic loss before its backward (`finite_or_zero`); a non-finite one is
  never back-propagated (a zero loss on the same graph runs instead, so no NaN reaches the gradients), and before
  the optimizer step the ranks agree whether any was found;
- **grad norm**: the optimizer step's gradient norm (DeepSpeed's, before clipping) after the step (an fp16 loss
  scaler's skipped step, an overflow it answers by lowering the scale, is not one).

`rl.on_nonfinite fail` (the default): `NonFiniteError`, one `error:` line naming the step, the source and what to
try, before the optimizer step for rewards and losses (the weights stay as they were); status.json says failed.
`skip`: the step is skipped before its update (reward, advantage), the micro-batches with a non-finite loss are
left out of its update, or a step whose gradient norm is not finite is skipped where the engine did not apply it
(DeepSpeed's overflow check); a warning names the step. A non-finite gradient the engine applied leaves weights
that are not finite: that stops the run under either setting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_rlhf.distributed import agree_max
from ds_rlhf.errors import UserInputError

POLICIES = ("fail", "skip")
HINTS = {
    "reward": "a reward must be a number finite in float32 (|r| < 3.4e38): check the reward functions, the "
              "environment or the reward model",
    "advantage": "the rewards are finite but their advantages or returns are not: scale the rewards down",
    "loss": "lower optim.lr, check the rewards' scale and the loss settings (rl.clip_*, rl.sapo_tau_*, "
            "rl.tis_cap), or use model.dtype bf16 / fp32 rather than fp16",
    "grad norm": "lower optim.lr, keep optim.grad_clip > 0, or use model.dtype bf16 / fp32 rather than fp16",
}


class NonFiniteError(UserInputError):
    """A reward, loss or gradient norm of a step that is not finite (under `rl.on_nonfinite fail`, or one the
    engine applied): one line naming the step, the source and what to try."""


class NonFinite(Exception):
    """What `policy_update` raises on a non-finite number (`source`: reward | advantage | loss | grad norm);
    `applied`: the optimizer step took it (the weights it left are not finite: no skip can undo it). The trainer turns
    it into `NonFiniteError` or a skipped step (`guard_step`)."""

    def __init__(self, source: str, detail: str, applied: bool = False):
        super().__init__(f"{source}: {detail}")
        self.source, self.detail, self.applied = source, detail, applied


def _first_bad(values: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[int, float] | None:
    """(row, value) of the first non-finite entry of `values` (where `mask`), or None."""
    bad = ~torch.isfinite(values.float())
    if mask is not None:
        bad &= mask.bool()
    if not bool(bad.any()):
        return None
    index = bad.nonzero()[0]
    return int(index[0]), float(values[tuple(index)])


def check_inputs(exp, device) -> None:
    """`NonFinite` when any rank's trajectory `exp` holds a non-finite reward (sequence or per-step) or, with
    finite rewards, a non-finite advantage or return on a response token. Collective (one scalar all-reduce)."""
    found = None
    for name, values, mask in (("reward", exp.scores, None), ("reward", exp.step_rewards, exp.action_mask),
                               ("advantage", exp.advantages, exp.action_mask),
                               ("advantage", exp.returns, exp.action_mask)):
        bad = _first_bad(values, mask) if values is not None else None
        if bad is not None:
            found = (name, f"sample {bad[0]} of this rank: {bad[1]} in float32")
            break
    codes = {"advantage": 1, "reward": 2}  # a reward outranks the advantage it makes non-finite
    code = agree_max(codes[found[0]] if found else 0, device)
    if code:
        name = "reward" if code == 2 else "advantage"
        raise NonFinite(name, found[1] if found and found[0] == name else "on another rank")


def finite_or_zero(loss: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`loss` and True when it is finite; else a zero loss on `anchor`'s graph (its backward runs the same
    collectives and adds no gradient) and False."""
    if bool(torch.isfinite(loss.detach()).all()):
        return loss, True
    return anchor.nan_to_num(0.0, 0.0, 0.0).sum() * 0.0, False


def check_losses(found: list[str], policy: str, device) -> int:
    """Before an optimizer step: the number of micro-batches with a non-finite loss on the rank with the most
    (collective); `NonFinite` under `fail` when any rank found one. `found`: this rank's, described."""
    count = agree_max(len(found), device)
    if count and policy == "fail":
        raise NonFinite("loss", found[0] if found else "on another rank")
    return count


def check_grad_norm(engine, norm: float | None, name: str) -> None:
    """After an optimizer step: `NonFinite` when its gradient norm `norm` (the same on every rank) is not finite;
    `applied` unless the engine says it skipped the step. An fp16 engine's skipped step is its loss scaler at work
    (an overflow lowers the scale and the step is skipped): not an error."""
    if norm is None or torch.isfinite(torch.tensor(float(norm))):
        return
    applied = bool(engine.was_step_applied()) if hasattr(engine, "was_step_applied") else True
    if not applied and hasattr(engine, "fp16_enabled") and engine.fp16_enabled():
        return
    raise NonFinite("grad norm", f"{name} gradient norm {norm}", applied=applied)


def message(step: int, found: NonFinite, policy: str) -> str:
    what = f"step {step}: the {found.source} is not finite ({found.detail})"
    if found.applied:
        return (f"{what} and the optimizer applied it, so the weights are not finite; {HINTS[found.source]}; "
                "resume from the last checkpoint")
    return f"{what}; {HINTS[found.source]}" + ("; or --rl.on_nonfinite skip to skip such steps"
                                               if policy == "fail" else "")


def guard_step(run_step: Callable[[], dict], *, step: int, policy: str, print_fn=print,
               on_skip: Callable[[], object] | None = None) -> dict:
    """`run_step()`'s metrics for step `step` (1-based); a `NonFinite` it raises becomes `NonFiniteError` (policy
    `fail`, or a step the optimizer applied) or, under `skip`, a warning and the skipped step's metrics
    (`guard/skipped_steps` 1; `on_skip` runs first, e.g. to drop the phase timers' partial figures). A step that
    left micro-batches with a non-finite loss out of its update (`guard/nonfinite_micro_batches`) gets a warning."""
    try:
        metrics = run_step()
    except NonFinite as found:
        if policy != "skip" or found.applied:
            raise NonFiniteError(message(step, found, policy)) from None
        if on_skip is not None:
            on_skip()
        print_fn(f"[rl] warning: {message(step, found, policy)}: step {step} skipped, no update "
                 "(rl.on_nonfinite skip)")
        return {"guard/skipped_steps": 1.0}
    left_out = metrics.get("guard/nonfinite_micro_batches", 0.0)
    if left_out:
        print_fn(f"[rl] warning: step {step}: the loss of {left_out:g} micro-batch(es) was not finite: left out "
                 f"of the update (rl.on_nonfinite skip); {HINTS['loss']}")
    return metrics
