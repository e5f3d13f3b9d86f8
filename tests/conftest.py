"""Session-wide fixtures: the tiny models are built once per session, torch.distributed is initialised once.

Environment defaults are set before anything imports deepspeed or vllm, so `pytest` works without
`scripts/env.sh` too (the Makefile sources it anyway).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HAS_GPU = os.path.exists("/dev/nvidia0")
for key, value in {
    "DS_RLHF_CACHE": str(ROOT / ".cache" / "ds_rlhf"),
    "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    **({} if _HAS_GPU else {"DS_ACCELERATOR": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    # Under pytest-xdist the workers share the machine's cores: one OpenMP thread each (and in their children),
    # instead of every worker spinning one thread per core.
    **({"OMP_NUM_THREADS": "1"} if os.environ.get("PYTEST_XDIST_WORKER") else {}),
}.items():
    os.environ.setdefault(key, value)

SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from ds_rlhf.engines.tiny_models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_reward_path() -> Path:
    from ds_rlhf.engines.tiny_models import build_tiny_reward_model

    return build_tiny_reward_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def dist_single():
    """torch.distributed (gloo) with world size 1 in this process, as DeepSpeed expects; set up once."""
    import torch.distributed as dist

    from ds_rlhf.distributed import ensure_distributed
    from ds_rlhf.testing.multiproc import free_port

    if not dist.is_initialized():
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                               WORLD_SIZE="1", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1").items():
            os.environ[key] = value
        ensure_distributed()
    yield dist


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real GSM8K / HH-RLHF sample files beside the checkout; tests skip when they are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def vllm_colocated(tiny_model_path, dist_single):
    """One in-process vLLM rollout engine on the tiny model for the whole session (vLLM starts once).

    Colocated placement, float32 on CPU. Built after `dist_single`, as the trainer does (DeepSpeed first). Tests that
    change its weights restore them afterwards, or load what they need first; skipped where vLLM is not importable.
    """
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")
    from ds_rlhf.rollout import make_rollout_engine

    engine = make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path),
                                 dtype="auto" if _HAS_GPU else "float32", max_model_len=512, seed=0,
                                 gpu_memory_utilization=0.3)
    yield engine
    engine.close()


@pytest.fixture
def lora_rollout(lora_engine):
    """`lora_engine` serving its base model (no adapter a previous test synced): each test starts from the base."""
    lora_engine.serve_base()
    return lora_engine


@pytest.fixture(scope="session")
def lora_engine(tiny_model_path, dist_single):
    """A colocated vLLM engine with LoRA enabled (rank 8) on the tiny model (adapter-only sync: tests/rollout/
    test_adapter_sync.py, tests/recipes/test_low_memory.py). Session-scoped: closing a vLLM engine
    (EngineCore.shutdown -> cleanup_dist_env_and_memory) destroys torch.distributed's default group, which later
    tests in the same worker still need."""
    from ds_rlhf.rollout.vllm_adapter import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not importable here")
    from ds_rlhf.rollout import make_rollout_engine

    engine = make_rollout_engine("vllm", "colocated", model_path=str(tiny_model_path), dtype="float32",
                                 max_model_len=256, seed=0, gpu_memory_utilization=0.3,
                                 lora={"rank": 8, "targets": "all-linear"})
    yield engine
    engine.close()


def pytest_collection_modifyitems(config, items):
    """Slow and heavy tests first (stable otherwise), so parallel workers start the long runs early and finish
    together; then the tests of the LoRA engine, side by side: xdist's worksteal hands each worker a contiguous share
    of this order (and steals from its end), so one worker builds that session-scoped vLLM engine instead of both."""
    items.sort(key=lambda item: (not any(item.get_closest_marker(m) for m in ("slow", "heavy")),
                                 not {"lora_engine", "lora_rollout"} & set(getattr(item, "fixturenames", ()))))
