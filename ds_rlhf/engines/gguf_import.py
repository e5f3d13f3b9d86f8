"""A GGUF file (llama.cpp's format, often quantized) -> a Hugging Face safetensors directory that transformers,
vLLM and the trainers load like any other model.

Transformers reads the GGUF (with the pure-Python `gguf` package): the config and tokenizer from its metadata, the
weights dequantized to float32. The result is written with `save_pretrained` in the asked dtype, with the tokenizer
(and its chat template) and a generation config, into a temp directory swapped in at OUT_DIR.

GGUF metadata does not always agree with the chat template about the special tokens, and transformers' reading of it
varies by version (one reads SmolLM2's eos as `<|im_start|>`, the next as `<|im_end|>`). `fix_special_tokens` makes
them agree: the end of an assistant turn, as the chat template renders it, becomes the tokenizer's eos and is in
`generation_config.eos_token_id` (what generation stops at); the pad token is set to the eos where it is missing or is
a token the chat template itself writes (a pad of `<|im_start|>` would hide every turn start from the masks). Every
change is listed in the report, printed and written to OUT_DIR/conversion.json.

`cached_conversion` converts a file once into a cache directory named by the file's sha256 and the dtype, and
returns that directory on later calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ds_rlhf.atomic_files import publish_dir
from ds_rlhf.config import ConfigError
from ds_rlhf.engines.chat_tokens import end_of_turn_token, template_tokens
from ds_rlhf.engines.models import as_dtype

GGUF_MAGIC = b"GGUF"
DTYPES = ("bf16", "fp16", "fp32")
REPORT_NAME = "conversion.json"
GGUF_PIN = "gguf==0.19.0"


class GGUFImportError(ConfigError):
    """The GGUF file cannot be converted as asked; the message names the input and what to change."""


# ---- checks -----------------------------------------------------------------------------------------------------
def check_gguf_file(src: Path) -> None:
    """A readable file that starts with the GGUF magic bytes, else a one-line GGUFImportError."""
    src = Path(src)
    if not src.is_file():
        raise GGUFImportError(f"{src}: no such file (pass the path of a .gguf model file)")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{src} is not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# GGUF architecture names transformers reads under another name (its load_gguf_checkpoint does the same)
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
                 "t5encoder": "t5"}


def check_architecture(src: Path, architecture, tf_version: str) -> None:
    """The file's `general.architecture` is one transformers converts, else a one-line GGUFImportError naming it and
    the supported ones (before the tokenizer and the weights are read)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    name = str(architecture) if architecture is not None else None
    if name is not None and (name in supported or _ARCH_ALIASES.get(name, name.replace("-", "_")) in supported):
        return
    said = f"architecture {name!r}" if name is not None else "no general.architecture"
    raise GGUFImportError(f"{src}: GGUF {said} is not one transformers {tf_version} converts (supported: "
                          f"{', '.join(sorted(supported))})")


def require_gguf_package():
    """The `gguf` module (transformers needs it to read GGUF files), else a one-line GGUFImportError."""
    try:
        import gguf
    except ImportError:
        raise GGUFImportError(f"reading a GGUF file needs the `gguf` package: pip install {GGUF_PIN}") from None
    return gguf


def gguf_metadata(src: Path) -> dict:
    """A few facts from the file's header for the report: architecture, name, quantization, tensor count."""
    gguf = require_gguf_package()
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as exc:  # the reader's errors for a damaged file vary (ValueError, IndexError, ...)
        raise GGUFImportError(f"{src}: cannot read it as GGUF ({type(exc).__name__}: {exc}); is the file complete?"
                              ) from None

    def field(key):
        entry = reader.fields.get(key)
        return None if entry is None else entry.contents()

    file_type = field("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = str(file_type)
    return {"architecture": field("general.architecture"), "name": field("general.name"), "quantization": quant,
            "tensors": len(reader.tensors)}


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---- special tokens ---------------------------------------------------------------------------------------------
def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def fix_special_tokens(tokenizer, model_config, generation_config) -> list[dict]:
    """Make eos / pad agree with the chat template, in place; returns the changes (field, from, to, why).

    - eos: the template's end-of-turn token (`chat_tokens.end_of_turn_token`) when the tokenizer's eos differs from it;
    - `generation_config.eos_token_id` / `model_config.eos_token_id`: the end-of-turn id first, then the ids they held
      before except the replaced eos;
    - pad: the eos when the tokenizer has none, or when its pad is a token the template writes other than the
      end-of-turn (padding must not be confused with a turn start).
    """
    changes: list[dict] = []

    def record(field: str, old, new, why: str) -> None:
        if old != new:
            changes.append({"field": field, "from": old, "to": new, "why": why})

    eot = end_of_turn_token(tokenizer)
    replaced: int | None = None
    if eot is not None and tokenizer.eos_token != eot:
        old = tokenizer.eos_token
        replaced = tokenizer.eos_token_id
        tokenizer.eos_token = eot
        record("tokenizer.eos_token", old, eot, f"the chat template ends an assistant turn with {eot}")
    eos_id = tokenizer.eos_token_id
    if eos_id is not None:
        for name, cfg in (("generation_config", generation_config), ("config", model_config)):
            old_ids = _ids(getattr(cfg, "eos_token_id", None))
            new_ids = [eos_id] + [i for i in old_ids if i not in (eos_id, replaced)]
            new = new_ids[0] if len(new_ids) == 1 else new_ids
            old = old_ids[0] if len(old_ids) == 1 else (old_ids or None)
            if old != new:
                cfg.eos_token_id = new
                record(f"{name}.eos_token_id", old, new, f"generation stops at the end of a turn ({tokenizer.eos_token}"
                                                         f" = {eos_id})")
    pad = tokenizer.pad_token
    if tokenizer.eos_token is not None and (pad is None or (pad != tokenizer.eos_token and
                                                            pad in template_tokens(tokenizer))):
        tokenizer.pad_token = tokenizer.eos_token
        why = "no pad token" if pad is None else f"{pad} is a token the chat template writes"
        record("tokenizer.pad_token", pad, tokenizer.pad_token, f"{why}; pad = eos, as the original model")
    pad_id = tokenizer.pad_token_id
    if pad_id is not None:
        for name, cfg in (("generation_config", generation_config), ("config", model_config)):
            old = getattr(cfg, "pad_token_id", None)
            if old != pad_id:
                cfg.pad_token_id = pad_id
                record(f"{name}.pad_token_id", old, pad_id, f"the tokenizer's pad ({tokenizer.pad_token})")
    return changes


# ---- conversion -------------------------------------------------------------------------------------------------
def _phase(text: str, log: Callable[[str], None]) -> float:
    log(f"[convert-gguf] {text}")
    return time.perf_counter()


def _nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def convert_gguf(src: Path, out_dir: Path, dtype: str = "bf16", overwrite: bool = False,
                 log: Callable[[str], None] = print) -> dict:
    """Convert the GGUF file `src` into a Hugging Face directory at `out_dir` (see the module docstring); returns the
    report (also written to OUT_DIR/conversion.json). Raises GGUFImportError for a missing or non-GGUF file, a
    missing `gguf` package, an unknown dtype or an existing non-empty `out_dir` without `overwrite`."""
    src, out_dir = Path(src), Path(out_dir)
    _check_inputs(src, out_dir, dtype, overwrite)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as tf_version

    start = _phase(f"reading {src.name} ({src.stat().st_size / 2**20:.0f} MiB)", log)
    meta = gguf_metadata(src)
    check_architecture(src, meta["architecture"], tf_version)
    sha = file_sha256(src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as exc:  # a tokenizer type transformers cannot read
        raise GGUFImportError(f"{src}: transformers cannot read its tokenizer ({_first_line(exc)})") from None
    t = _phase(f"dequantizing {meta['tensors']} tensors ({meta['quantization']}) to float32 (tens of seconds on a "
               "CPU)", log)
    try:
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as exc:  # an architecture / quant type transformers lacks
        raise GGUFImportError(f"{src}: transformers cannot load it ({_first_line(exc)})") from None
    load_s = time.perf_counter() - t
    # Dequantized, the model is an ordinary one: drop the quantizer so save_pretrained writes plain weights.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.to(as_dtype(dtype))
    model.config.use_cache = True
    changes = fix_special_tokens(tokenizer, model.config, model.generation_config)
    model.generation_config._from_model_config = False  # written on purpose: generate() must not re-derive it
    changes += _cap_model_max_length(tokenizer, model.config)
    report = {
        "source": str(src.resolve()), "sha256": sha, "size": src.stat().st_size, **meta, "dtype": dtype,
        "model_class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
        "eos_token": [tokenizer.eos_token, tokenizer.eos_token_id],
        "pad_token": [tokenizer.pad_token, tokenizer.pad_token_id],
        "end_of_turn": end_of_turn_token(tokenizer), "generation_eos_token_id": model.generation_config.eos_token_id,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)), "changes": changes,
        "transformers": tf_version, "gguf": _gguf_version(), "dequantize_seconds": round(load_s, 1),
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")

    _phase(f"writing {dtype} safetensors to {out_dir}", log)
    publish_dir(out_dir, write)
    report["seconds"] = round(time.perf_counter() - start, 1)
    for line in summary(report):
        log(f"[convert-gguf] {line}")
    return report


def _check_inputs(src: Path, out_dir: Path, dtype: str, overwrite: bool) -> None:
    """GGUFImportError for an unknown dtype, a missing or non-GGUF `src`, no `gguf` package, or an `out_dir` that is
    a file or (without `overwrite`) a non-empty directory."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_gguf_file(src)
    require_gguf_package()
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFImportError(f"{out_dir} exists and is not a directory: pick another output directory")
    if _nonempty_dir(out_dir) and not overwrite:
        raise GGUFImportError(f"{out_dir} exists and is not empty: pass --overwrite to replace it, or pick another "
                              "output directory")


def _cap_model_max_length(tokenizer, config) -> list[dict]:
    """A tokenizer `model_max_length` over 10x the model's context length set to that length; the change made."""
    max_len = getattr(config, "max_position_embeddings", None)
    if not max_len or (tokenizer.model_max_length or 0) <= 10 * max_len:
        return []
    change = {"field": "tokenizer.model_max_length", "from": tokenizer.model_max_length, "to": max_len,
              "why": "the model's context length"}
    tokenizer.model_max_length = max_len
    return [change]


def _gguf_version() -> str | None:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version("gguf")
    return None


def summary(report: dict) -> list[str]:
    """The report in a few lines."""
    lines = [f"{report['model_class']} ({report['architecture']}, {report['parameters'] / 1e6:.1f}M parameters, "
             f"{report['quantization']} -> {report['dtype']}) in {report.get('seconds', '?')} s",
             f"eos {report['eos_token'][0]} ({report['eos_token'][1]}), pad {report['pad_token'][0]} "
             f"({report['pad_token'][1]}), generation stops at {report['generation_eos_token_id']}"]
    if not report["chat_template"]:
        lines.append("warning: the GGUF has no chat template; chat-formatted data needs a tokenizer that has one")
    lines += [f"changed {c['field']}: {c['from']!r} -> {c['to']!r} ({c['why']})" for c in report["changes"]]
    if not report["changes"]:
        lines.append("special tokens agree with the chat template: nothing changed")
    return lines


# ---- cache ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached_sha256(src: Path, cache_root: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so a multi-GB file is hashed once, not at every start."""
    stat = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_root / ".sha256" / key
    if memo.is_file():
        return memo.read_text().strip()
    sha = file_sha256(src)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}")
    tmp.write_text(sha)
    os.replace(tmp, memo)
    return sha


def cached_conversion(src: Path, cache_root: Path, dtype: str = "bf16",
                      log: Callable[[str], None] | None = None) -> Path:
    """The converted directory of `src` under `cache_root` (named by the file's sha256 and the dtype); converts it
    the first time, once across concurrent processes (a file lock), and returns it as it is afterwards."""
    src, cache_root = Path(src), Path(cache_root)
    check_gguf_file(src)
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    sha = _cached_sha256(src, cache_root)
    target = cache_root / f"{src.stem}-{sha[:16]}-{dtype}"
    if (target / REPORT_NAME).is_file():
        return target
    with _locked(cache_root / f".{target.name}.lock"):
        if not (target / REPORT_NAME).is_file():  # another process may have finished it while this one waited
            convert_gguf(src, target, dtype, overwrite=True,
                         log=log or (lambda text: print(text, file=sys.stderr, flush=True)))
    return target
