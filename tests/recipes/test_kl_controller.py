"""The adaptive KL controller moves by the step's sample count (Ziegler et al. 2019), not by one."""

from __future__ import annotations

import pytest

from ds_rlhf.algos.kl import AdaptiveKLController
from ds_rlhf.recipes.rl import update_kl_controller


def _reference_update(beta: float, kl: float, target: float, horizon: float, n: int) -> float:
    """Ziegler et al. 2019, sec. 2.2: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e * n / horizon."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n / horizon)


@pytest.mark.parametrize("world_size, samples_per_rank", [(1, 256), (4, 64), (2, 37)])
def test_per_step_change_at_twice_the_target_matches_the_reference(world_size, samples_per_rank):
    beta, target, horizon = 0.05, 0.1, 10000
    ctl = AdaptiveKLController(beta, target, horizon)
    # the step's metrics as the trainer has them: averaged over ranks
    metrics = {"kl/mean": 2 * target, "rollout/samples": float(samples_per_rank)}
    new = update_kl_controller(ctl, metrics, world_size)
    expected = _reference_update(beta, 2 * target, target, horizon, samples_per_rank * world_size)
    assert abs((new - beta) - (expected - beta)) <= 1e-12
    assert new == ctl.value and new > beta * 1.0001  # it adapts: 0.2 * 256 / 10000 = +0.51% per step


def test_below_target_beta_shrinks():
    ctl = AdaptiveKLController(0.05, 0.1, 1000)
    new = update_kl_controller(ctl, {"kl/mean": 0.0, "rollout/samples": 100.0}, 1)
    assert new == pytest.approx(0.05 * (1 - 0.2 * 100 / 1000), abs=1e-15)
