"""Placement checks: impossible layouts fail before anything loads, with a message that says what to change."""

from __future__ import annotations

import pytest

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.run.placement import parse_devices, resolve_placement


def _resolve(argv, world=4, local=4, gpus=8, visible=None, monkeypatch=None):
    if monkeypatch is not None:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return resolve_placement(parse_config(argv), world_size=world, local_world_size=local, gpus_on_node=gpus)


def test_parse_devices():
    assert parse_devices("4,5,6,7") == parse_devices("4-7") == parse_devices("7,4-6") == [4, 5, 6, 7]
    assert parse_devices("") == []
    for bad in ("4,4", "a", "7-4", "-1"):
        with pytest.raises(ConfigError):
            parse_devices(bad)


def test_actor_on_0_3_and_vllm_tp4_on_4_7(monkeypatch):
    p = _resolve(["--rollout.placement", "disaggregated", "--rollout.devices", "4-7",
                  "--rollout.tensor_parallel_size", "4"], monkeypatch=monkeypatch)
    assert p.train_devices == (0, 1, 2, 3) and p.rollout_devices == (4, 5, 6, 7)
    assert p.engine_kwargs() == {"tensor_parallel_size": 4, "devices": [4, 5, 6, 7]}


def test_launcher_restricted_gpus_are_honoured(monkeypatch):
    # deepspeed --include localhost:4,5 -> the ranks see CUDA_VISIBLE_DEVICES=4,5 and train on physical 4 and 5
    p = _resolve(["--rollout.placement", "disaggregated", "--rollout.devices", "0-1",
                  "--rollout.tensor_parallel_size", "2"], world=2, local=2, visible="4,5", monkeypatch=monkeypatch)
    assert p.train_devices == (4, 5)
    with pytest.raises(ConfigError, match=r"overlap the training ranks' GPUs \[4, 5\] at \[5\]"):
        _resolve(["--rollout.placement", "disaggregated", "--rollout.devices", "5,6",
                  "--rollout.tensor_parallel_size", "2"], world=2, local=2, visible="4,5", monkeypatch=monkeypatch)


@pytest.mark.parametrize("argv, kw, message", [
    (["--rollout.placement", "disaggregated", "--rollout.devices", "2,3,4,5", "--rollout.tensor_parallel_size", "4"],
     {}, "overlap the training ranks"),
    (["--rollout.placement", "disaggregated"], {}, r"needs rollout.devices .*free on this node: \[4, 5, 6, 7\]"),
    (["--rollout.placement", "disaggregated", "--rollout.devices", "6-9", "--rollout.tensor_parallel_size", "4"],
     {}, r"\[8, 9\] do not exist"),
    (["--rollout.placement", "disaggregated", "--rollout.devices", "4-7"], {}, "tensor_parallel_size=4"),
    (["--rollout.devices", "4"], {}, "is for rollout.placement=disaggregated"),
    (["--rollout.tensor_parallel_size", "3"], {}, "choose a tp that divides"),
    ([], {"local": 9}, "the node has 8"),
    (["--rollout.placement", "disaggregated", "--rollout.devices", "1"], {"gpus": 0}, "has none"),
])
def test_impossible_layouts_are_refused(argv, kw, message, monkeypatch):
    with pytest.raises(ConfigError, match=message):
        _resolve(argv, monkeypatch=monkeypatch, **kw)


def test_cpu_layouts(monkeypatch):
    assert _resolve([], world=2, local=2, gpus=0, monkeypatch=monkeypatch).train_devices == ()
    p = _resolve(["--rollout.placement", "disaggregated"], world=2, local=2, gpus=0, monkeypatch=monkeypatch)
    assert p.mode == "disaggregated" and p.engine_kwargs() == {"tensor_parallel_size": 1}
