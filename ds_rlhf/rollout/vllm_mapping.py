"""The pure half of the vLLM adapter: no vLLM import and no vLLM call here (those stay in the adapter layer,
`vllm_adapter.py`, `vllm_handle.py`, `vllm_transfer.py`, `vllm_worker.py`).

What lives here only maps values: the version gate's parsing and range check (`check_version`), our engine options
-> `LLM(...)` keywords given the installed vLLM's argument names and log-prob modes (`option_kwargs`), FP8
rollouts -> vLLM's online quantization method (`quantization_kwargs`), a
`SamplingSpec` -> `SamplingParams` keywords (`sampling_kwargs`), vLLM's request outputs -> `RolloutSample`s
(`samples_from_outputs`, `chosen_logprobs`), and, for `rollout.weight_transport vllm`, the engine keyword
(`weight_transfer_kwargs`), our weight buckets -> the (name, tensor) stream vLLM's producers pack
(`named_tensors_from_buckets`, `transfer_buffer_bytes`) and the NCCL engine's init / update infos
(`nccl_worker_init_info`, `nccl_update_info`, `nccl_wire`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from importlib import metadata

import torch

from ds_rlhf.config_sections import WEIGHT_TRANSPORTS
from ds_rlhf.errors import ConfigError
from ds_rlhf.rollout.base import BucketPlan, RolloutError, RolloutSample, SamplingSpec
from ds_rlhf.rollout.weights.group import bucket_nbytes

log = logging.getLogger("ds_rlhf.rollout.vllm_adapter")  # the adapter's logger: its messages read as the adapter's

SUPPORTED_RANGE = ((0, 26), (0, 32))  # inclusive, (major, minor)
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # DeepSpeed precision names -> vLLM
LOGPROBS_MODE = "processed_logprobs"  # log-probs of the distribution vLLM sampled from (the rollout contract)
# our engine option (config key rollout.<name>) -> vLLM EngineArgs field
ENGINE_OPTIONS = {"async_scheduling": "async_scheduling", "max_num_seqs": "max_num_seqs",
                  "max_num_batched_tokens": "max_num_batched_tokens", "cudagraph_sizes": "cudagraph_capture_sizes",
                  "enforce_eager": "enforce_eager"}
IN_PROCESS_EXECUTORS = ("uni", "external_launcher")  # engine core in this process: collective_rpc by reference


def check_version(version: str | None) -> tuple[int, int]:
    """(major, minor) of vLLM `version` (None: vLLM not importable); RolloutError outside SUPPORTED_RANGE unless
    DS_RLHF_ALLOW_UNKNOWN_VLLM=1 (then a warning)."""
    if version is None:
        raise RolloutError("vLLM is not importable here; install it or use backend='hf'")
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError as e:
        raise RolloutError(f"cannot parse vLLM version {version!r}") from e
    lo, hi = SUPPORTED_RANGE
    if not lo <= (major, minor) <= hi:
        msg = (f"vLLM {version} is not a version ds_rlhf knows (supported: {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}); "
               "its LLM/worker APIs may differ. Install a supported version, or set DS_RLHF_ALLOW_UNKNOWN_VLLM=1 "
               "to try it anyway (then check the sync canary).")
        if os.environ.get("DS_RLHF_ALLOW_UNKNOWN_VLLM") != "1":
            raise RolloutError(msg)
        log.warning(msg)
    return major, minor


def option_kwargs(*, cpu: bool, version: str | None, arg_names: Collection[str], modes: Sequence[str],
                  enforce_eager: bool | None = None, async_scheduling: bool | None = None, max_num_seqs: int = 0,
                  max_num_batched_tokens: int = 0, cudagraph_sizes: Sequence[int] = ()) -> dict:
    """`LLM(...)` keywords for the log-prob mode and the engine options, given the vLLM's `EngineArgs` field names
    and `logprobs_mode` values (`vllm_adapter.engine_option_kwargs` passes the installed vLLM's)."""
    if "logprobs_mode" not in arg_names or LOGPROBS_MODE not in modes:
        raise RolloutError(f"vLLM {version} has no logprobs_mode={LOGPROBS_MODE!r} engine argument (it has "
                           f"{list(modes) or 'no logprobs_mode'}): the rollout log-probs must be those of the "
                           "distribution vLLM sampled from; use vLLM 0.26 to 0.32")
    out: dict = {"logprobs_mode": LOGPROBS_MODE, "enforce_eager": cpu if enforce_eager is None else enforce_eager}
    if async_scheduling is not None:
        if async_scheduling and cpu:
            raise RolloutError(f"rollout.async_scheduling=true: vLLM {version} on CPU has no async scheduling (its "
                               "CPU platform always turns it off); leave it at auto on CPU")
        out["async_scheduling"] = bool(async_scheduling)
    if max_num_seqs:
        out["max_num_seqs"] = int(max_num_seqs)
    if max_num_batched_tokens:
        out["max_num_batched_tokens"] = int(max_num_batched_tokens)
    sizes = sorted({int(n) for n in cudagraph_sizes})
    if sizes and cpu:
        log.info("rollout.cudagraph_sizes=%s ignored: vLLM on CPU captures no CUDA graphs", sizes)
    elif sizes:
        if out["enforce_eager"]:
            raise RolloutError(f"rollout.cudagraph_sizes={sizes} with enforce_eager: eager mode captures no CUDA "
                               "graphs")
        out["cudagraph_capture_sizes"] = sizes
    by_field = {field: name for name, field in ENGINE_OPTIONS.items()}
    missing = [k for k in out if k not in arg_names and k in by_field]
    if missing:
        names = ", ".join(f"rollout.{by_field[k]} (EngineArgs.{k})" for k in missing)
        raise RolloutError(f"vLLM {version} does not support {names}: leave the option at its default or install a "
                           "vLLM that has it")
    return out


# rollout.quantization / rollout.fp8_scales -> vLLM's online quantization method (`LLM(quantization=...)`): the
# checkpoint's bf16 weights are quantized while they load, per tensor or per 128x128 block (a name in 0.26 and 0.32)
QUANTIZATION_METHODS = {("fp8", "tensor"): "fp8_per_tensor", ("fp8", "block"): "fp8_per_block"}


def quantization_kwargs(quantization: str, scales: str = "tensor", *, cpu: bool, version: str | None,
                        methods: Collection[str]) -> dict:
    """`LLM(...)` keywords for `rollout.quantization` (none: nothing) given the installed vLLM's quantization
    method names (`methods`). ConfigError where it cannot run: vLLM-CPU (its FP8 kernels need AMX tiles and are not
    the CUDA kernels measured), a vLLM without the online method, an unknown setting."""
    if quantization == "none":
        return {}
    method = QUANTIZATION_METHODS.get((quantization, scales))
    where = f"rollout.quantization={quantization} (rollout.fp8_scales={scales})"
    if method is None:
        raise ConfigError(f"{where}: no such FP8 rollout setting (allowed: quantization none|fp8, fp8_scales "
                          "tensor|block)")
    if cpu:
        raise ConfigError(f"{where} needs vLLM on a CUDA GPU with FP8 support; this vLLM ({version}) runs on the CPU: "
                          "use --rollout.quantization none")
    if method not in methods:
        raise ConfigError(f"{where}: vLLM {version} has no {method!r} quantization method; use vLLM 0.26 to 0.32 "
                          "or --rollout.quantization none")
    return {"quantization": method}


def sampling_kwargs(spec: SamplingSpec, seed: int | None, *, flat: bool, **extra) -> dict:
    """`SamplingParams(...)` keywords for one request of `spec` (token ids only; `flat`: the vLLM has
    `flat_logprobs`, one flat list instead of a dict per token, far less Python overhead)."""
    kw = dict(n=spec.n, max_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p,
              top_k=spec.top_k if spec.top_k > 0 else 0, stop_token_ids=list(spec.stop_token_ids),
              ignore_eos=spec.ignore_eos, seed=seed, detokenize=False, **extra)
    if flat:
        kw["flat_logprobs"] = True
    return kw


def samples_from_outputs(groups: Sequence[tuple[list[list[int]], SamplingSpec]],
                         outputs: Iterable) -> list[list[RolloutSample]]:
    """vLLM's request outputs (one per prompt, in the order of `groups`' prompts) as `RolloutSample`s per group,
    prompt-major; RolloutError for a request that finished neither by a stop nor by length (aborted?)."""
    outs = iter(outputs)
    results = []
    for prompts, _ in groups:
        samples = []
        for i, prompt in enumerate(prompts):
            for comp in sorted(next(outs).outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                if comp.finish_reason not in ("stop", "length"):
                    raise RolloutError(f"vLLM finished a request with reason {comp.finish_reason!r} (aborted?)")
                samples.append(RolloutSample(i, comp.index, list(prompt), ids,
                                             chosen_logprobs(comp.logprobs, ids), comp.finish_reason))
        results.append(samples)
    return results


def chosen_logprobs(container, token_ids: list[int], skip_first: bool = False) -> list[float]:
    """Log-prob of each `token_ids[k]` from vLLM's per-position logprobs (dicts or FlatLogprobs)."""
    if container is None:
        raise RolloutError("vLLM returned no logprobs (request made without logprobs?)")
    positions = range(1, len(token_ids)) if skip_first else range(len(token_ids))
    if hasattr(container, "start_indices"):  # FlatLogprobs
        starts, ends = container.start_indices, container.end_indices
        ids, vals = container.token_ids, container.logprobs
        out = []
        for k in positions:
            for j in range(starts[k], ends[k]):
                if ids[j] == token_ids[k]:
                    out.append(vals[j])
                    break
            else:
                raise RolloutError(f"vLLM logprobs at position {k} lack the chosen token {token_ids[k]}")
        return out
    return [container[k][token_ids[k]].logprob for k in positions]


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def vllm_distribution() -> tuple[str | None, str | None, list[str]]:
    """(distribution name, version, all vLLM distributions installed): `vllm` (CUDA) or `vllm-cpu`."""
    found = [(d, v) for d in ("vllm", "vllm-cpu") if (v := _installed_version(d))]
    if not found:
        return None, None, []
    return found[0][0], found[0][1], [d for d, _ in found]


TRANSFER_BACKENDS = ("ipc", "nccl")  # vLLM's engine for "vllm": CUDA IPC (sidecar) / NCCL (disaggregated)
NCCL_NUM_BUFFERS = 2  # chunks in flight in vLLM's packed NCCL broadcast (its default), on both ends


def weight_transfer_kwargs(transport: str, *, version: str | None, arg_names: Collection[str],
                           backend: str = "ipc") -> dict:
    """`LLM(...)` keywords for `transport`: none for "own" and "shared" (the server sets its loader: `vllm_shared.py`);
    for "vllm", vLLM's weight-transfer engine of `backend`
    ("ipc": a sidecar server on the trainer's GPU; "nccl": a disaggregated server on other GPUs) as
    `weight_transfer_config`, an `EngineArgs` field in 0.26 and 0.32 that takes a dict. RolloutError naming the
    setting when the transport or backend is unknown or the installed vLLM has no such engine argument."""
    if transport not in WEIGHT_TRANSPORTS:
        raise RolloutError(f"rollout.weight_transport={transport!r}: choose one of {', '.join(WEIGHT_TRANSPORTS)}")
    if transport != "vllm":
        return {}
    if backend not in TRANSFER_BACKENDS:
        raise RolloutError(f"rollout.weight_transport=vllm: no vLLM weight-transfer backend {backend!r} (one of "
                           f"{', '.join(TRANSFER_BACKENDS)})")
    if "weight_transfer_config" not in arg_names:
        raise RolloutError(f"rollout.weight_transport=vllm: vLLM {version} has no weight_transfer_config engine "
                           "argument; use --rollout.weight_transport own")
    return {"weight_transfer_config": {"backend": backend}}


def nccl_wire(buffer_bytes: int, num_buffers: int = NCCL_NUM_BUFFERS) -> dict:
    """The packed-broadcast parameters both ends of vLLM's NCCL engine must agree on (chunks cut at `buffer_bytes`,
    `num_buffers` of them in flight). vLLM 0.26 carries them in every update info, 0.32 in the init info."""
    return {"packed": True, "packed_buffer_size_bytes": int(buffer_bytes), "packed_num_buffers": int(num_buffers)}


def nccl_worker_init_info(host: str, port: int, world_size: int) -> dict:
    """vLLM 0.26's `NCCLWeightTransferInitInfo` for the server's workers: the trainer is rank 0 of the
    `world_size` group (1 + the server's tensor-parallel ranks), worker r joins as rank 1 + r."""
    return {"master_address": host, "master_port": int(port), "rank_offset": 1, "world_size": int(world_size)}


def nccl_update_info(plan: BucketPlan, wire: dict | None = None) -> dict:
    """vLLM's NCCL update info for one sync of `plan`: every tensor's name, dtype name and shape, in the order the
    stream sends them (`named_tensors_from_buckets`: bucket by bucket, as planned). The receiver cuts the packed
    chunks from these alone, so they must follow the stream exactly. `wire` (vLLM 0.26: `nccl_wire`) is added."""
    metas = [m for bucket in plan for m in bucket]
    return {"names": [m.name for m in metas], "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metas],
            "shapes": [[int(d) for d in m.shape] for m in metas], **(wire or {})}


def update_info_nbytes(update_info: dict) -> int:
    """The bytes one vLLM update info announces: its chunk's `tensor_sizes` (IPC), else its tensors' shapes and
    dtype names (NCCL)."""
    if update_info.get("tensor_sizes") is not None:
        return sum(update_info["tensor_sizes"])
    return sum(math.prod(shape) * torch.empty((), dtype=getattr(torch, name)).element_size()
               for name, shape in zip(update_info.get("dtype_names", ()), update_info.get("shapes", ())))


def transfer_buffer_bytes(plan: BucketPlan) -> int:
    """The size of the IPC buffer vLLM's packed producer allocates for a sync: the largest bucket of `plan` (our
    own transport's buffer is that size too), so every tensor fits and chunks are at most a bucket."""
    return max((bucket_nbytes(metas) for metas in plan), default=1)


def named_tensors_from_buckets(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
                               plan: BucketPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Our weight buckets as the flat (name, tensor) stream vLLM's producer takes, each tensor cast to the plan's
    dtype (the rollout engine's, e.g. bf16 from an fp32 trainer). Lazy: a ZeRO-3 bucket is gathered only when the
    producer reaches it and may be released after it. RolloutError when the buckets do not follow the plan (names,
    shapes, or their number)."""
    sent = 0
    for i, (bucket, metas) in enumerate(zip(buckets, plan)):
        names = [n for n, _ in bucket]
        if names != [m.name for m in metas]:
            raise RolloutError(f"bucket {i} does not match the announced plan: {names[:3]} vs "
                               f"{[m.name for m in metas][:3]}")
        for (name, t), m in zip(bucket, metas):
            if tuple(t.shape) != tuple(m.shape):
                raise RolloutError(f"{name}: shape {tuple(t.shape)} differs from the announced {m.shape}")
            yield name, t.detach().to(m.dtype)
        sent += 1
    if sent != len(plan):
        raise RolloutError(f"sent {sent} buckets but announced {len(plan)}")


def kv_cache_kwargs(kv_cache_bytes: int, *, cpu: bool, version: str | None, arg_names: Collection[str], free: int,
                    env: dict | None = None) -> dict:
    """`LLM(...)` keywords for a KV cache of `kv_cache_bytes` (`memory/kv_cache.py` sizes it; 0: vLLM's own sizing):
    `kv_cache_memory_bytes`, which vLLM allocates as it is (its CPU worker then skips its RAM-share check). On CPU a
    `VLLM_CPU_KVCACHE_SPACE` set in the environment wins (vLLM's CPU platform reads it over any argument), so nothing
    is passed then. Refuses, before vLLM starts, a CPU KV cache above `free` (the memory available now)."""
    env = os.environ if env is None else env
    if not kv_cache_bytes or (cpu and env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()):
        return {}
    if cpu and free < kv_cache_bytes:
        raise RolloutError(f"vLLM-CPU's KV cache of {kv_cache_bytes / 2**30:.2f} GiB is more than the "
                           f"{free / 2**30:.2f} GiB of memory available now: lower rollout.kv_cache_gb (or "
                           "rollout.max_num_seqs, rollout.max_model_len), or free memory")
    if "kv_cache_memory_bytes" not in arg_names:
        raise RolloutError(f"vLLM {version} has no kv_cache_memory_bytes engine argument: leave rollout.kv_cache_gb "
                           "at 0" + (" and set VLLM_CPU_KVCACHE_SPACE (GiB)" if cpu else
                                     " and set rollout.gpu_memory_utilization (vLLM then sizes its KV cache)"))
    return {"kv_cache_memory_bytes": int(kv_cache_bytes)}
