"""A fake `nvidia-cuda-mps-control` for CPU tests of the SM split (`run/gpu_split.py`): the real one needs an NVIDIA
GPU and driver. `install(bin_dir, record)` writes an executable that appends each call to `record` as a JSON line
(its arguments, its MPS variables, what it read on stdin) and exits 0; `calls(record, n)` waits for n of them."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

MPS_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def install(bin_dir: Path, record: Path) -> Path:
    """The fake control in `bin_dir` (put that first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import json, os, sys
        stdin = "" if "-d" in sys.argv else sys.stdin.read()
        call = {{"argv": sys.argv[1:], "stdin": stdin, **{{k: os.environ.get(k) for k in {MPS_VARS!r}}}}}
        with open({str(record)!r}, "a") as f:
            f.write(json.dumps(call) + "\\n")
        """))
    script.chmod(0o755)
    return script


def install_on_path(tmp_path: Path, monkeypatch) -> Path:
    """`install` under `tmp_path/bin`, first on PATH, with no MPS variable in the environment (pytest's
    `monkeypatch` undoes both); returns the file its calls are recorded in (JSON lines)."""
    record = tmp_path / "calls.jsonl"
    install(tmp_path / "bin", record)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for var in MPS_VARS:
        monkeypatch.delenv(var, raising=False)
    return record


def calls(record: Path, n: int, timeout: float = 30.0) -> list[dict]:
    """The recorded calls once there are at least `n` (AssertionError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = record.read_text().splitlines() if record.exists() else []
        if len(lines) >= n:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)
    raise AssertionError(f"expected {n} calls of the fake control, got {record.read_text() if record.exists() else 0}")
