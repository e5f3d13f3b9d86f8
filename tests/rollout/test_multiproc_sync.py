"""World size 2 (two gloo processes): DeepSpeed ZeRO-0 and ZeRO-3 trainers syncing into vLLM, both placements.

- colocated: vLLM's external_launcher inside both trainer processes (one replica per rank by default; TP = 2 in
  the slow variant), each rank generating its own prompts;
- disaggregated: vLLM in a third process; rank 0 streams flattened buckets over a dedicated gloo group while rank 1
  takes part in the ZeRO-3 gathers only, and sends its prompts / canary probe through rank 0.
Each run checks: rollout matches the checkpoint at first, does NOT match after three optimizer steps, matches
again after the sync (max abs log-prob diff < 1e-4, float32), and the canary fires on every rank when a sync is
skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_helpers import STALE_MIN, TOL

from ds_rlhf.testing.multiproc import run_workers

HERE = str(Path(__file__).resolve().parent)
pytestmark = [pytest.mark.multiproc, pytest.mark.extended]


@pytest.fixture(autouse=True)
def _needs_vllm():
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")


def _check_stages(result: dict, stages: list[int], sender: bool = True) -> None:
    assert result["own_samples"], "each rank must get the samples of its own prompts"
    for stage in stages:
        r = result["stages"][str(stage)]
        assert r["initial"] < TOL, (stage, r)
        assert r["stale"] > STALE_MIN, (stage, r)
        assert r["after"] < TOL and r["gen_diff"] < TOL, (stage, r)
        if sender:  # a disaggregated proxy rank only drains ZeRO-3 gathers and ships nothing
            assert r["bytes"] > 0 and r["buckets"] > 5, (stage, r)
    assert "not serving the trained weights" in result["canary_error"]


def test_colocated_world2(tiny_model_path):
    results = run_workers("rollout_helpers:colocated_worker", 2,
                          {"model_path": str(tiny_model_path), "stages": [0, 3]}, env={"PYTHONPATH": HERE})
    for res in results:
        _check_stages(res, [0, 3])


@pytest.mark.slow
def test_colocated_world2_tensor_parallel(tiny_model_path):
    results = run_workers("rollout_helpers:colocated_worker", 2,
                          {"model_path": str(tiny_model_path), "stages": [3], "tp": 2}, env={"PYTHONPATH": HERE})
    for res in results:
        _check_stages(res, [3])


def test_disaggregated_world2(tiny_model_path, tmp_path):
    log = tmp_path / "server.log"
    try:
        results = run_workers("rollout_helpers:disaggregated_worker", 2,
                              {"model_path": str(tiny_model_path), "stages": [0, 3]},
                              env={"PYTHONPATH": HERE, "DS_RLHF_TEST_SERVER_LOG": str(log)})
    except RuntimeError as e:
        tail = log.read_text()[-3000:] if log.exists() else "(no server log)"
        raise AssertionError(f"{e}\n--- rollout server log tail:\n{tail}") from e
    _check_stages(results[0], [0, 3])
    _check_stages(results[1], [0, 3], sender=False)
    server = results[0]["server_stats"]
    # 3 checkpoint restores + 2 syncs went through the weight group, nothing else
    assert server["weight_updates"] == 5 and server["weight_bytes"] > 0
