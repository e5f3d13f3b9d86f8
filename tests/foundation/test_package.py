"""The project as an installed package: console scripts, the `ds-rlhf` umbrella, scripts runnable from any directory.

scripts/setup.sh installs the checkout editable; these tests check what that install gives a user, in fresh
processes started outside the checkout (no PYTHONPATH), so nothing here passes thanks to the test session's sys.path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ds_rlhf.entrypoints.main import SUBCOMMANDS, resolve

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

# command -> a piece of its --help text that only that command prints (for the prep commands: an option of theirs)
HELP_TEXT = {
    "train-sft": "Supervised fine-tuning (step 1)",
    "train-rm": "Reward-model training (step 2)",
    "train-ppo": "Train a policy with RL (PPO, GRPO",
    "train-dpo": "Direct preference optimisation of the policy",
    "pipeline": "data prep -> SFT -> reward model -> RL",
    "prep-prompts": "--input_key",
    "prep-gsm8k": "--kind",
    "prep-sft": "--messages_key",
    "prep-preferences": "--chosen_key",
    "doctor": "--data-dir",
    "memory": "--gpu-memory-gb",
    "report": "--no-doctor",
    "export": "merge the adapters into the weights",
    "autotune": "--keep-checkpoints",
    "bench": "bench/ is not a package",
    "convert-gguf": "--overwrite",
    "serve-rm": "--max-len",
}


def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_scripts_table_matches_subcommands():
    """Every umbrella subcommand is also its own `ds-rlhf-<name>` script with the same target, and vice versa."""
    assert SCRIPTS["ds-rlhf"] == "ds_rlhf.entrypoints.main:main"
    own = {name: target for name, target in SCRIPTS.items() if name != "ds-rlhf"}
    assert own == {f"ds-rlhf-{name}": target for name, (target, _) in SUBCOMMANDS.items()}
    assert set(HELP_TEXT) == set(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        assert callable(resolve(name)), name


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_help(script, tmp_path):
    exe = BIN / script
    assert exe.is_file() and os.access(exe, os.X_OK), f"{exe} missing: run scripts/setup.sh"
    out = _run([exe, "--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    if script == "ds-rlhf":
        for name, (_, help_) in SUBCOMMANDS.items():
            assert f"  {name}" in out.stdout and help_ in out.stdout
    else:
        assert HELP_TEXT[script.removeprefix("ds-rlhf-")] in out.stdout


def test_umbrella_dispatch_and_errors(tmp_path):
    out = _run([BIN / "ds-rlhf", "prep-gsm8k", "--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and HELP_TEXT["prep-gsm8k"] in out.stdout and "--tokenizer" in out.stdout
    out = _run([BIN / "ds-rlhf", "trian-ppo"], cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "did you mean `ds-rlhf train-ppo`" in out.stderr
    out = _run([BIN / "ds-rlhf"], cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "commands:" in out.stdout
    out = _run([sys.executable, "-m", "ds_rlhf.entrypoints", "--version"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ds-rlhf ")


def test_editable_install_from_another_directory(tmp_path):
    """`import ds_rlhf` works anywhere and is this checkout; the scripts folders are not installed as packages."""
    code = "import ds_rlhf, importlib.util as u; print(ds_rlhf.__file__); print(u.find_spec('data_prep'))"
    out = _run([sys.executable, "-c", code], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    path, spec = out.stdout.split()
    assert Path(path).resolve() == (ROOT / "ds_rlhf" / "__init__.py").resolve()
    assert spec == "None"


@pytest.mark.parametrize("script,text", [("launch/train_ppo.py", HELP_TEXT["train-ppo"]),
                                         ("launch/train_sft.py", HELP_TEXT["train-sft"]),
                                         ("launch/pipeline.py", HELP_TEXT["pipeline"]),
                                         ("data_prep/prep_gsm8k.py", HELP_TEXT["prep-gsm8k"])])
def test_checkout_scripts_run_from_another_directory(script, text, tmp_path):
    out = _run([sys.executable, ROOT / script, "--help"], cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert text in out.stdout


def test_no_sys_path_shims():
    needle = "sys.path." + "insert"  # split so this file does not match itself wherever it is moved
    hits = []
    for folder in ("ds_rlhf", "launch", "data_prep", "bench"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            hits += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert not hits, f"sys.path shims left (the package is installed; import it): {hits}"
