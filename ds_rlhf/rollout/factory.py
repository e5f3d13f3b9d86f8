"""Pick and build a rollout engine: `make_rollout_engine(backend, placement, model_path=..., ...)`.

backend: "vllm", "hf", or "auto" (vLLM when a supported version imports, else HF `generate` with a warning: the
run still works, only generation is much slower). placement: "colocated" (vLLM in this process, sharing the
trainer's GPU(s); with several ranks vLLM's SPMD external_launcher, one replica per rank unless
tensor_parallel_size > 1) or "disaggregated" (vLLM in its own process on
`devices=[...]`, weights over a dedicated gloo/NCCL group; build it on trainer rank 0 only) or "sidecar" (that
process on the trainer's own GPU, so generation can overlap training).
"""

from __future__ import annotations

import logging

from ds_rlhf.errors import ConfigError
from ds_rlhf.rollout import vllm_adapter  # module attributes: tests replace them
from ds_rlhf.rollout.base import RolloutEngine
from ds_rlhf.rollout.hf_engine import HFRolloutEngine
from ds_rlhf.rollout.server import client as server_client
from ds_rlhf.rollout.server import process as server_process
from ds_rlhf.rollout.server import sharded
from ds_rlhf.rollout.vllm_engine import VLLMRolloutEngine
from ds_rlhf.rollout.vllm_mapping import ENGINE_OPTIONS

log = logging.getLogger(__name__)


def resolve_backend(backend: str = "auto") -> str:
    if backend not in ("auto", "vllm", "hf"):
        raise ValueError(f"unknown rollout backend {backend!r}: expected 'auto', 'vllm' or 'hf'")
    if backend != "auto":
        return backend

    version = vllm_adapter.vllm_version()
    if version is None:
        log.warning("vLLM is not importable here: falling back to the Hugging Face generate backend (much slower "
                    "rollouts). Install vLLM, or pass backend='hf' to silence this warning.")
        return "hf"
    try:
        vllm_adapter.check_vllm_version(version)
    except RuntimeError as e:
        log.warning("%s Falling back to the Hugging Face generate backend.", e)
        return "hf"
    return "vllm"


def make_rollout_engine(backend: str = "auto", placement: str = "colocated", *, model_path: str,
                        dtype: str = "auto", max_model_len: int = 1024, gpu_memory_utilization: float = 0.5,
                        seed: int = 0, enable_sleep: bool = False, kv_cache_bytes: int = 0, **kw) -> RolloutEngine:
    """Build a RolloutEngine. Extra keywords go to the engine (e.g. tensor_parallel_size, sleep_level, devices,
    weight_backend, load_format, skip_tokenizer_init, batch_size for HF), among them the vLLM engine options of
    `RolloutConfig.vllm_options()` (async_scheduling, max_num_seqs, max_num_batched_tokens, cudagraph_sizes,
    enforce_eager) for every placement; the HF backend has none of those and says so when one is set.
    `quantization="fp8"` (with `fp8_scales` "tensor" / "block"): FP8 rollouts, vLLM only (ConfigError on HF).
    `lora={"rank": r, "targets": ...}` starts the engine with LoRA for adapter sync (colocated vLLM only).
    `weight_transport="vllm"` (sidecar and disaggregated): the servers' engines are built with vLLM's weight-transfer
    config and syncs go through vLLM's weight-transfer engine: CUDA IPC on the sidecar
    (`server/transports.py:VLLMIPC`), NCCL into a server on other GPUs (`VLLMNCCL`). `transport=name` (sidecar and
    disaggregated) picks a registered transport of `server/transports.py:TRANSPORTS` by name instead.
    `kv_cache_bytes` (vLLM only; 0 = vLLM's own sizing): the KV cache `memory/kv_cache.py` sized for the run.
    `server_env={...}` (sidecar and disaggregated): variables every server process gets on top of this process's
    environment (the SM split's share, `run/gpu_split.py`).
    `sidecar_engines=N` (sidecar only): N server processes, each with 1/N of `gpu_memory_utilization` (and of
    `kv_cache_bytes`) and its own seed, behind one `ShardedRolloutEngine` that splits every batch between them
    (`server/sharded.py`)."""
    if placement not in ("colocated", "sidecar", "disaggregated"):
        raise ValueError(f"unknown placement {placement!r}: expected 'colocated', 'sidecar' or 'disaggregated'")
    n_engines = kw.pop("sidecar_engines", 1)
    if n_engines > 1 and placement != "sidecar":
        raise ValueError(f"sidecar_engines={n_engines} needs placement='sidecar', got {placement!r}")
    if kw.get("weight_transport", "own") != "own" and placement == "colocated":
        raise ValueError(f"weight_transport={kw['weight_transport']!r} needs placement='sidecar' or 'disaggregated' "
                         "(vLLM's weight transfer into a server process), got 'colocated'")
    backend = resolve_backend(backend)
    if kw.get("lora") and (backend != "vllm" or placement != "colocated"):
        raise ValueError(f"adapter sync (lora={kw['lora']}) needs the colocated vLLM engine, got backend={backend!r}, "
                         f"placement={placement!r}: use rollout.lora_sync=merged there")
    if not kw.get("lora"):
        kw.pop("lora", None)  # lora=None: an ordinary engine, whatever the backend
    common = dict(dtype=dtype, max_model_len=max_model_len, seed=seed)
    if backend == "hf":
        if kw.pop("quantization", "none") != "none":
            raise ConfigError("rollout.quantization=fp8 runs vLLM's FP8 kernels, but the rollout backend is HF "
                              "generate (vLLM is not importable or not a supported version here): install vLLM 0.26 "
                              "to 0.32 on a CUDA machine or use --rollout.quantization none")
        kw.pop("fp8_scales", None)
        if placement != "colocated":
            raise ValueError("the HF generate backend only runs colocated (in the trainer's process)")

        unused = {k: kw.pop(k) for k in list(kw) if k in ENGINE_OPTIONS}
        if unused:
            log.warning("the HF generate backend ignores the vLLM engine options %s",
                        ", ".join(f"rollout.{k}={v}" for k, v in unused.items()))

        return HFRolloutEngine(str(model_path), **common, **kw)
    vllm_kw = dict(common, gpu_memory_utilization=gpu_memory_utilization, enable_sleep=enable_sleep,
                   kv_cache_bytes=kv_cache_bytes)
    if placement == "colocated":
        return VLLMRolloutEngine(str(model_path), **vllm_kw, **kw)

    client_keys = ("devices", "weight_backend", "timeout_s", "startup_timeout_s", "bucket_bytes", "log_path", "host",
                   "transport", "server_env")
    client = {k: kw.pop(k) for k in client_keys if k in kw}
    if n_engines == 1:
        return server_client.RemoteVLLMEngine(str(model_path), **client, **vllm_kw, **kw)
    return _sharded(n_engines, str(model_path), client, vllm_kw, kw)


def _sharded(n: int, model_path: str, client: dict, vllm_kw: dict, kw: dict) -> RolloutEngine:
    """`n` sidecar servers spawned at once (each imports vLLM meanwhile: `server/process.py`), their engines built
    one after the other (vLLM measures free memory at start-up), then one engine over them; a failed start closes
    the servers already running and those not yet started."""
    log_paths = [f"{client['log_path']}.{i}" if client.get("log_path") else None for i in range(n)]
    processes = server_process.spawn_servers(n, devices=client.get("devices"), log_paths=log_paths,
                                             host=client.get("host", "127.0.0.1"),
                                             extra_env=client.get("server_env"))
    engines: list = []
    try:
        for i in range(n):
            own = dict(vllm_kw, gpu_memory_utilization=vllm_kw["gpu_memory_utilization"] / n, seed=vllm_kw["seed"] + i,
                       kv_cache_bytes=vllm_kw["kv_cache_bytes"] // n)
            # what the first server's transport made (shared weights: the buffer), for every later one
            state = getattr(getattr(engines[0], "weights", None), "state", None) if engines else None
            engines.append(server_client.RemoteVLLMEngine(model_path, **dict(client, log_path=log_paths[i]),
                                                   process=processes[i], transport_state=state, **own, **kw))
        return sharded.ShardedRolloutEngine(engines)
    except BaseException:
        for e in engines:
            e.close()
        for process in processes[len(engines):]:  # the one that failed (closing twice is harmless) and the rest
            if process is not None:
                process.close()
        raise
