"""The doctor's checks put together: every probe of this machine (`run_checks`: versions, GPUs, interconnect, vLLM,
DeepSpeed builds, I/O; `checks.py`, `system_checks.py`), what a run's config needs of them (`apply_config`), and
their table and JSON. `ds-rlhf doctor` prints them; a run writes them to environment.json (`monitor.py`)."""

from __future__ import annotations

import os
import time

import torch

from ds_rlhf.engines.attention import VARLEN_NAME, available_impls, choice_path, measured_choice, select_attn_impl
from ds_rlhf.memory.kv_cache import GiB, available_host_bytes, vllm_kv_cache
from ds_rlhf.memory.meta_models import hf_config
from ds_rlhf.run import checks as sw
from ds_rlhf.run import system_checks as hw
from ds_rlhf.run.checks import FAIL, OK, WARN, Check
from ds_rlhf.run.package_checks import check_torch_companions


def run_checks(data_dir: str | os.PathLike = ".") -> list[Check]:
    """Every check, in display order (each bounded; together a few seconds)."""
    driver = hw.driver_info()
    out = [sw.check_core_packages(), sw.check_pins(), sw.check_torch(driver), check_torch_companions()]
    gpu = _safe(hw.check_gpus, "GPUs")
    out.append(gpu)
    gpus = int(gpu.facts.get("count", 0))
    link = _safe(lambda: hw.check_interconnect(gpus), "interconnect")
    out += [link, _safe(lambda: sw.check_vllm(gpus), "vLLM"), _safe(lambda: sw.check_flash_attn(gpus), "flash-attn"),
            _safe(lambda: check_attention(gpus), "attention"),
            _safe(lambda: sw.check_liger(gpus), "liger-kernel"),
            _safe(lambda: sw.check_jit_toolchain(gpus), "DeepSpeed JIT build"), sw.check_arch_list(gpus),
            _safe(lambda: hw.check_data_dir(data_dir), "data dir I/O"), hw.check_shm(gpus),
            hw.check_nccl_env(gpus, bool(link.facts.get("nvlink"))), hw.check_accelerator_env(gpus)]
    return out


def _safe(probe, name: str) -> Check:
    """A probe that raised is a warn line naming the error, never a doctor crash."""
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001
        return Check(name, WARN, f"probe failed: {type(exc).__name__}: {exc}", "report this as a doctor bug")


def check_attention(gpus: int) -> Check:
    """Which attention kernel `model.attn_impl auto` gives each path on this machine, and why: the RL models see
    padded rows unless `data.rl_packing` (rl_build.rl_attention), SFT / RM resolve without that hint
    (models._hf_kwargs). Both go through engines/attention.py:select_attn_impl, called here as they call it, at the
    precision `auto` picks (bf16 on a GPU that has it, else fp16; fp32 on CPU)."""
    device = "cuda" if gpus and torch.cuda.is_available() else "cpu"
    dtype = torch.float32
    if device == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    padded = select_attn_impl("auto", device, dtype, padded=True)
    packed = select_attn_impl("auto", device, dtype, padded=False)
    usable = available_impls(device, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    why = []
    if (measured := measured_choice(device, dtype)) in usable:
        why.append(f"{measured} recorded as fastest here by bench/attention.py --save-choice ({choice_path()})")
    else:
        if "flash_attention_2" in usable:
            why.append("flash-attn installed: first choice")
        elif device == "cuda":
            why.append("flash-attn not installed (optional; auto would pick it first)")
        if VARLEN_NAME in usable:
            why.append(f"auto skips {VARLEN_NAME} for padded rows (measured slower than sdpa there)")
        else:
            why.append(f"{VARLEN_NAME} needs CUDA with fp16/bf16")
    found = (f"model.attn_impl auto on {device} ({dtype_name}): RL padded rows (default) -> {padded}; RL packed "
             f"rows (data.rl_packing), SFT and RM -> {packed}; " + "; ".join(why))
    facts = {"device": device, "dtype": dtype_name, "rl_padded": padded, "rl_packed": packed, "sft_rm": packed,
             "usable": usable}
    return Check("attention", OK, found, facts=facts)


def by_name(results: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in results}


# ---- what a config needs -----------------------------------------------------------------------------------------
def _replace(results: list[Check], new: Check) -> list[Check]:
    return [new if c.name == new.name else c for c in results]


def _need(results: list[Check], name: str, why: str, fix: str | None = None) -> list[Check]:
    """Make line `name` FAIL because the config needs what it lacks (kept as it is when it is already FAIL)."""
    current = by_name(results)[name]
    if current.verdict == FAIL:
        return results
    return _replace(results, current.with_verdict(FAIL, fix, why=f"needed: {why}"))


def apply_config(results: list[Check], cfg) -> list[Check]:
    """The run's requirements turn the matching lines into FAIL (see the module docstring)."""
    c = by_name(results)
    gpus = int(c["GPUs"].facts.get("count", 0))
    vllm = c["vLLM"].facts
    backend = cfg.rollout.backend
    if backend == "vllm" or (backend == "auto" and gpus):
        what = f"rollout.backend={backend}" + (" on a GPU machine" if backend == "auto" else "")
        if not vllm.get("installed"):
            results = _need(results, "vLLM", what, f"{sw.install_fix('cuda' if gpus else 'cpu')}, or "
                            "--rollout.backend hf")
        elif c["vLLM"].verdict != OK:
            results = _need(results, "vLLM", what)
    if (backend == "vllm" or (backend == "auto" and vllm.get("installed"))) and (kv := check_kv_cache(cfg, gpus)):
        results = [*results, kv]
    dtype = cfg.model.dtype
    if dtype == "fp16" and not gpus:
        results = _need(results, "GPUs", "model.dtype=fp16 needs CUDA (DeepSpeed's CPU accelerator has no fp16)",
                        "use --model.dtype fp32 or bf16 on CPU, or run on a GPU machine")
    if dtype == "bf16" and gpus and not c["GPUs"].facts.get("bf16"):
        results = _need(results, "GPUs", "model.dtype=bf16 but a GPU lacks bf16", "use --model.dtype fp16")
    if cfg.model.attn_impl == "flash_attention_2" and not c["flash-attn"].facts.get("installed"):
        results = _need(results, "flash-attn", "model.attn_impl=flash_attention_2",
                        f"{sw.FLASH_ATTN_INSTALL}, or --model.attn_impl auto")
    if cfg.model.kernels == "liger":
        if not c["liger-kernel"].facts.get("installed"):
            results = _need(results, "liger-kernel", "model.kernels=liger",
                            "pip install liger-kernel, or --model.kernels auto")
        if not gpus:
            results = _need(results, "GPUs", "model.kernels=liger needs CUDA (Triton kernels)", "--model.kernels auto")
    if cfg.model.attn_impl == "flash_attention_2" and not gpus:
        results = _need(results, "GPUs", "model.attn_impl=flash_attention_2 needs CUDA", "--model.attn_impl auto")
    if c["DeepSpeed JIT build"].verdict != OK:  # FusedAdam (GPU and CPU), cpu_adam (GPU offload): JIT-built
        results = _need(results, "DeepSpeed JIT build", "training builds DeepSpeed's Adam op on first use")
    if c["TORCH_CUDA_ARCH_LIST"].verdict != OK and gpus:
        results = _need(results, "TORCH_CUDA_ARCH_LIST", "the GPU Adam op is JIT-built")
    if cfg.data.reader == "uring" and not str(c["data dir I/O"].facts.get("reader", "")).startswith("io_uring"):
        results = _need(results, "data dir I/O", "data.reader=uring", "--data.reader auto (falls back to mmap)")
    return results


def check_kv_cache(cfg, gpus: int) -> Check | None:
    """vLLM's KV cache as the run will size it (`memory/kv_cache.py`: the number the trainer passes to vLLM and
    `ds-rlhf memory` plans with), on CPU against the memory available now; None on GPUs without
    rollout.kv_cache_gb (vLLM's own sizing, or the work's, which `ds-rlhf memory` prints with the engines' share)."""
    device = "cuda" if gpus else "cpu"
    if device == "cuda" and cfg.rollout.kv_cache_gb <= 0:
        return None
    try:
        model_config = hf_config(cfg.model.path)
    except Exception as exc:  # noqa: BLE001 - a model that cannot be read here is the run's problem, named once
        return Check("vLLM KV cache", WARN, f"cannot read model.path={cfg.model.path}'s config ({type(exc).__name__})",
                     "check model.path (a local directory, a .gguf file or a Hub id in the cache)")
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = vllm_kv_cache(cfg, model_config, device=device, host_bytes=host // ranks, world_size=ranks)
    facts = {"bytes": size.bytes, "source": size.source, "detail": size.detail}
    found = f"{size.line()}"
    if device == "cpu":
        free = available_host_bytes()
        facts["available_bytes"] = free
        found += f"; {free / GiB:.1f} GiB of memory available now"
        if size.bytes > free:
            return Check("vLLM KV cache", FAIL, found, "lower rollout.kv_cache_gb (or rollout.max_num_seqs, "
                         "rollout.max_model_len), or free memory", facts)
    return Check("vLLM KV cache", OK, found, facts=facts)


# ---- output ------------------------------------------------------------------------------------------------------
def format_table(results: list[Check]) -> str:
    width = max(len(c.name) for c in results)
    lines = []
    for c in results:
        lines.append(f"{c.verdict:<4}  {c.name:<{width}}  {c.found}")
        if c.fix and c.verdict != OK:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    fails = sum(c.verdict == FAIL for c in results)
    warns = sum(c.verdict == WARN for c in results)
    lines.append(f"\n{len(results)} checks: {fails} FAIL, {warns} warn")
    return "\n".join(lines)


def doctor_json(results: list[Check], seconds: float | None = None) -> dict:
    out = {"checks": [c.to_dict() for c in results], "ok": not any(c.verdict == FAIL for c in results),
           "host": os.uname().nodename, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if seconds is not None:
        out["seconds"] = round(seconds, 2)
    return out
