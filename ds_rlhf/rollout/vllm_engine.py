"""Colocated vLLM rollout engine: vLLM shares the trainer's GPU(s) and runs inside the trainer's process.

One process per GPU. With one rank the engine uses vLLM's in-process "uni" executor; with several ranks it uses
vLLM's SPMD "external_launcher" on the trainer's existing torch.distributed world: world = DP x TP, TP innermost.
- TP = 1 (default): every rank holds a full replica and generates its own prompts (data parallel, like the trainer).
- TP > 1: the TP ranks of a group share one engine; each rank still passes its own prompts, the engine all-gathers
  them within the group, generates the union once and hands each rank its own samples back.
vLLM steps its data-parallel replicas in lockstep, so `generate` and `score` are collective: every rank must call
them the same number of times (the trainer does: every rank rolls out each step, every rank runs the canary).

Engine options (`async_scheduling`, `max_num_seqs`, `max_num_batched_tokens`, `cudagraph_sizes`, `enforce_eager`)
go through to `VLLMHandle` (checked against the installed vLLM there); `stats()["vllm_options"]` says what the
running engine uses.

LoRA (`lora={"rank": r, "targets": ...}`, for `rollout.lora_sync=adapter`): vLLM starts with LoRA enabled, loads
the frozen base from `model_path` once, and `weights.load_adapter(path)` switches every later request to the
synced adapter; `targets` are recorded only (the adapter's own `adapter_config.json` says which layers it adapts).

Memory: with `enable_sleep=True` (GPU only) `sleep()` frees vLLM's weights and KV cache while DeepSpeed trains; the
sync path wakes the weights first, loads the new ones in place, and wakes the KV cache last, so the KV cache is
re-allocated only once the trainer's gather buffers are gone; every wake first returns the allocator's cached
blocks to the driver (the woken pool is mapped past the allocator's cap). PyTorch's allocator keeps counting the
pool vLLM has unmapped, so after every sleep and wake the engine reports the unmapped bytes to `on_unmapped` (set by
`recipes/rl_build.py` under `run.max_gpu_memory_gb`: `memory.cap.allow_unmapped` raises the trainer's allocator cap
by them, keeping the cap on what the device holds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ds_rlhf.distributed import world as dist_world
from ds_rlhf.rollout.base import InProcessWeights, Pending, RolloutEngine, RolloutSample, SamplingSpec
from ds_rlhf.rollout.vllm_handle import VLLMHandle


def unmapped_bytes(pool: dict[str, int], awake: set[str]) -> int:
    """Bytes of vLLM's sleep-mode pool (`VLLMHandle.pool_bytes`) unmapped while the tags in `awake` are mapped:
    "weights" and "kv_cache" by their own state, any other tag with the weights."""
    return sum(n for tag, n in pool.items()
               if tag not in awake and (tag in ("weights", "kv_cache") or "weights" not in awake))


def _release_cached_blocks() -> None:
    """Before vLLM maps its pool back: waking maps physical memory with the driver directly, past PyTorch's
    allocator and its per-process fraction, so blocks the allocator caches (the weight sync's gather buffers, the
    last update's) would sit on the device beside the woken pool. On the H200 (8B GRPO under a 24 GiB cap) NVML read
    24.96 GiB without this, 23.61 GiB with it (and `memory.cap.HEADROOM` raised from 256 to 512 MiB with it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _tp_group(tp: int):
    """(process group of this rank's TP block, index in it); every rank creates every group, as new_group needs."""
    import torch.distributed as dist

    rank, world = dist_world()
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = (group, rank - start)
    return mine


class VLLMWeights(InProcessWeights):
    """Weights into a colocated vLLM engine: buckets loaded in place by its workers (the weight memory awake), or a
    LoRA engine's adapter directory served from now on."""

    def __init__(self, engine: VLLMRolloutEngine) -> None:
        super().__init__(self._load, engine.handle.dtype, engine.handle.reset_prefix_cache)
        self.engine = engine

    def send(self, buckets, plan=None, *, wait=True) -> Pending:
        """Every bucket of one sync, inside one reload of a quantized engine (`VLLMHandle.begin_reload`)."""
        handle = self.engine.handle
        handle.begin_reload()
        try:
            return super().send(buckets, plan, wait=wait)
        finally:
            handle.end_reload()

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.require_weights("updating weights")
        self.engine.handle.load_weights(named_tensors)

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def load_adapter(self, path: str) -> int:
        self.engine.require_weights("loading an adapter")
        t0 = time.perf_counter()
        adapter_id = self.engine.handle.load_adapter(path)
        self.record(sum(f.stat().st_size for f in Path(path).glob("*.safetensors")), time.perf_counter() - t0)
        self.engine.note_adapter(adapter_id)
        self.reset_cache()  # the prefix KV of the previous adapter
        return adapter_id


class VLLMRolloutEngine(RolloutEngine):
    backend = "vllm"
    placement = "colocated"

    def __init__(self, model_path: str, *, dtype: str = "auto", max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, enable_sleep: bool = False,
                 sleep_level: int = 1, tensor_parallel_size: int | None = None, executor: str | None = None,
                 lora: dict | None = None, **llm_kwargs) -> None:
        super().__init__()

        _, world = dist_world()
        if executor is None:
            executor = "external_launcher" if world > 1 else "uni"
        tp = tensor_parallel_size or 1
        dp = world // tp if executor == "external_launcher" else 1
        if executor == "external_launcher" and tp * dp != world:
            raise ValueError(f"tensor_parallel_size={tp} must divide the world size {world}")
        self._tp_group = _tp_group(tp) if executor == "external_launcher" and tp > 1 else None
        self.sleep_level = sleep_level
        self.lora = dict(lora) if lora else None
        if self.lora and enable_sleep and sleep_level >= 2:
            raise ValueError("a LoRA engine (adapter sync) cannot sleep at level 2: that drops vLLM's base weights, "
                             "which adapter sync never sends again; use sleep_level=1 or merged sync")
        if self.lora:
            llm_kwargs["lora_rank"] = int(self.lora["rank"])
        self.handle = VLLMHandle(model_path, dtype=dtype, max_model_len=max_model_len,
                                 gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep=enable_sleep,
                                 executor=executor, tensor_parallel_size=tp, data_parallel_size=dp, **llm_kwargs)
        self._c.extra.update(vllm_version=self.handle.version, executor=executor, tensor_parallel_size=tp,
                             start_seconds=self.handle.start_seconds, vllm_options=self.handle.options,
                             lora=self.lora)
        self._awake: set[str] = {"weights", "kv_cache"}
        self.on_unmapped: Callable[[int], object] | None = None  # see the module docstring
        self.weights = VLLMWeights(self)

    def _require_awake(self) -> None:
        if self._awake != {"weights", "kv_cache"}:
            raise RuntimeError(f"rollout engine is asleep (awake: {sorted(self._awake)}); call wake() first")

    def _gather(self, item) -> tuple[list, int]:
        """All TP-group members' `item`s and this rank's index among them (no group: just ours)."""
        if self._tp_group is None:
            return [item], 0
        import torch.distributed as dist

        group, index = self._tp_group
        items = [None] * dist.get_world_size(group)
        dist.all_gather_object(items, item, group=group)
        return items, index

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        self._require_awake()
        t0 = time.perf_counter()
        groups, index = self._gather((prompts, spec))
        results = self.handle.generate_many(groups)
        samples = results[index]
        self.record_generate(samples, time.perf_counter() - t0,
                              sum(len(s.response_ids) for r in results for s in r))  # every TP rank's tokens
        return samples

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        self._require_awake()
        groups, index = self._gather(sequences)
        scores = self.handle.logprobs([s for g in groups for s in g])
        start = sum(len(g) for g in groups[:index])
        return scores[start:start + len(sequences)]

    def serve_base(self) -> None:
        """Generate from the base model again, without the last loaded adapter (a LoRA engine reused by a new run)."""
        self.handle.serve_base()
        self._c.extra.pop("adapter_id", None)
        self.handle.reset_prefix_cache()

    def require_weights(self, what: str) -> None:
        """Raise unless the weight memory is mapped (`what`: the call that needs it)."""
        if "weights" not in self._awake:
            raise RuntimeError(f"wake(('weights',)) before {what}: the weight memory is released")

    def note_adapter(self, adapter_id: int) -> None:
        """Report the adapter served from now on (`stats()["adapter_id"]`)."""
        self._c.extra["adapter_id"] = adapter_id

    def sleep(self) -> None:
        if self.sleeping:
            return
        info = self.handle.sleep(self.sleep_level)
        self._c.extra.update(info)
        self._awake = set()
        self.sleeping = True
        self._report_unmapped()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        tags = ("weights", "kv_cache") if tags is None else tuple(tags)
        todo = [t for t in tags if t not in self._awake]
        if "kv_cache" in todo and "weights" not in self._awake and "weights" not in todo:
            todo.insert(0, "weights")  # vLLM needs weights back before the KV cache
        if todo:
            _release_cached_blocks()
            self._c.extra.update({f"wake_{'_'.join(todo)}_seconds": self.handle.wake(todo)["wake_seconds"]})
            self._awake.update(todo)
            self._report_unmapped()
        self.sleeping = self._awake != {"weights", "kv_cache"}

    def _report_unmapped(self) -> None:
        if self.on_unmapped is not None:
            self.on_unmapped(unmapped_bytes(self.handle.pool_bytes(), self._awake))

    def close(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            handle.close()
