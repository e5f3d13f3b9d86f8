"""The allocator cap around vLLM's sleep-mode pool on CPU: the trainer's fraction follows the pool vLLM has
unmapped while it sleeps, leaves room for the device bytes outside the allocator, and the colocated engine reports
its unmapped pool after each sleep and wake and returns the allocator's cached blocks before each wake. The
low-memory recipe and its runs: test_low_memory.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_rlhf.config import parse_config
from ds_rlhf.memory.plan import GiB


def test_the_cap_follows_a_sleeping_vllm_pool(monkeypatch):
    """PyTorch's allocator keeps counting vLLM's sleep-mode pool while vLLM has unmapped it (8B PPO on the H200:
    23.05 GiB 'allocated by PyTorch' with 5.97 GiB on the device, an OOM under the 24 GiB cap). The trainer's
    fraction is raised by the unmapped bytes while the colocated engine sleeps and restored when it wakes."""
    from ds_rlhf.memory import cap as memory_cap
    from ds_rlhf.rollout.vllm_engine import unmapped_bytes

    total, set_to = int(140 * GiB), []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: set_to.append(f))
    monkeypatch.setattr(memory_cap, "_APPLIED", {})
    monkeypatch.setattr(memory_cap, "non_torch_bytes", lambda device, unmapped=0: None)  # nothing measurable here
    device = torch.device("cuda", 0)
    assert memory_cap.allow_unmapped(device, GiB) is None and set_to == []  # no cap applied: nothing changes
    cfg = parse_config(["--run.max_gpu_memory_gb", "24"])
    assert memory_cap.apply_trainer_cap(cfg, device, "colocated") == pytest.approx(24 / 140)

    pool = {"weights": 15 * GiB, "kv_cache": 4 * GiB}
    asleep = unmapped_bytes(pool, set())
    weights_awake = unmapped_bytes(pool, {"weights"})
    assert (asleep, weights_awake, unmapped_bytes(pool, {"weights", "kv_cache"})) == (19 * GiB, 4 * GiB, 0)
    assert unmapped_bytes({**pool, "other": GiB}, set()) == 20 * GiB  # other tags sleep and wake with the weights
    assert memory_cap.allow_unmapped(device, asleep) == pytest.approx(43 / 140)
    assert memory_cap.allow_unmapped(device, weights_awake) == pytest.approx(28 / 140)
    assert memory_cap.allow_unmapped(device, 0) == pytest.approx(24 / 140)
    assert memory_cap.allow_unmapped(device, 1000 * GiB) == 1.0
    assert set_to == pytest.approx([24 / 140, 43 / 140, 28 / 140, 24 / 140, 1.0])


def test_the_cap_leaves_room_for_what_the_allocator_does_not_hold(monkeypatch):
    """The fraction caps PyTorch's allocator only (8B GRPO / PPO on the H200 under a 24 GiB cap: NVML read
    24.97 / 25.03 GiB with the allocator at its limit). Each time it is set, what the device holds outside this
    process's allocator (NVML's used bytes, else CUDA's total - free, minus the mapped reserved bytes) and a
    headroom come off the cap, but never more than the plan's 2 GiB reserve: another process's bytes look the same,
    and must not shrink the cap to nothing. Bytes the allocator counts but vLLM has unmapped are not on the device."""
    from ds_rlhf.memory import cap as memory_cap

    total, set_to = int(140 * GiB), []
    state = {"nvml": 2 * GiB, "free": total - int(1.5 * GiB), "reserved": 1 * GiB}

    def nvml(device):
        if state["nvml"] is None:
            raise ModuleNotFoundError("pynvml")
        return state["nvml"]

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: set_to.append(f))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], total))
    monkeypatch.setattr(torch.cuda, "device_memory_used", nvml)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(memory_cap, "_APPLIED", {})
    monkeypatch.setattr(memory_cap, "_OUTSIDE", {})
    device, room, reserve = torch.device("cuda", 0), memory_cap.HEADROOM, 2 * GiB
    cfg = parse_config(["--run.max_gpu_memory_gb", "24"])

    assert memory_cap.non_torch_bytes(device) == 1 * GiB  # NVML 2 GiB used, 1 GiB of it the allocator's
    assert memory_cap.apply_trainer_cap(cfg, device, "colocated") == pytest.approx((23 * GiB - room) / total)
    assert memory_cap.outside_bytes(device) == 1 * GiB and memory_cap.outside_warning(1 * GiB) is None
    state.update(nvml=3 * GiB, reserved=21 * GiB)  # vLLM asleep: 19 GiB of the 21 reserved are unmapped
    assert memory_cap.non_torch_bytes(device, 19 * GiB) == 1 * GiB
    assert memory_cap.allow_unmapped(device, 19 * GiB) == pytest.approx((42 * GiB - room) / total)
    state.update(nvml=None)  # no pynvml: CUDA's total - free (1.5 GiB used, 2 GiB of it mapped allocator bytes)
    assert memory_cap.non_torch_bytes(device, 19 * GiB) == 0
    assert memory_cap.allow_unmapped(device, 19 * GiB) == pytest.approx((43 * GiB - room) / total)
    state.update(nvml=33 * GiB, reserved=1 * GiB)  # another process holds 30 GiB of this GPU
    assert memory_cap.non_torch_bytes(device) == 32 * GiB
    assert memory_cap.allow_unmapped(device, 0) == pytest.approx((24 * GiB - reserve) / total)  # not 0.01
    warning = memory_cap.outside_warning(memory_cap.outside_bytes(device))
    assert "32.00 GiB" in warning and "reserve" in warning
    assert set_to == pytest.approx([(23 * GiB - room) / total, (42 * GiB - room) / total, (43 * GiB - room) / total,
                                    (24 * GiB - reserve) / total])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    assert memory_cap.non_torch_bytes(device) is None
    assert memory_cap.allow_unmapped(device, 0) == pytest.approx(24 / 140)  # unmeasurable: the cap as it is
    assert memory_cap.apply_trainer_cap(parse_config([]), device, "colocated") is None  # no cap: allocator untouched
    assert len(set_to) == 5


class PoolHandle:
    """VLLMHandle's sleep / wake / pool_bytes, without vLLM."""

    def sleep(self, level):
        return {"sleep_seconds": 0.0}

    def wake(self, tags):
        return {"wake_seconds": 0.0}

    def pool_bytes(self):
        return {"weights": 15 * GiB, "kv_cache": 4 * GiB}


def test_colocated_engine_reports_its_unmapped_pool_after_each_sleep_and_wake():
    from ds_rlhf.rollout.base import RolloutEngine
    from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # the sleep/wake bookkeeping only: no vLLM
    RolloutEngine.__init__(engine)
    engine.handle, engine.sleep_level, engine._awake, seen = PoolHandle(), 2, {"weights", "kv_cache"}, []
    engine.on_unmapped = seen.append
    engine.sleep()
    engine.wake(("weights",))
    engine.wake(("kv_cache",))
    engine.wake()  # already awake: nothing to report
    assert seen == [19 * GiB, 4 * GiB, 0] and not engine.sleeping


def test_colocated_engine_returns_cached_blocks_before_each_wake(monkeypatch):
    """vLLM maps its woken pool past PyTorch's allocator cap, so the allocator's cached blocks go back first."""
    import torch

    from ds_rlhf.rollout.base import RolloutEngine
    from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    calls = []

    class OrderedHandle(PoolHandle):
        def wake(self, tags):
            calls.append(("wake", tuple(tags)))
            return super().wake(tags)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = object.__new__(VLLMRolloutEngine)
    RolloutEngine.__init__(engine)
    engine.handle, engine.sleep_level, engine._awake, engine.on_unmapped = OrderedHandle(), 2, set(), None
    engine.sleeping = True
    engine.wake(("weights",))
    engine.wake(("kv_cache",))
    engine.wake()  # already awake: no wake, nothing released
    assert calls == ["empty_cache", ("wake", ("weights",)), "empty_cache", ("wake", ("kv_cache",))]
