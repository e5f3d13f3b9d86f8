"""Commands run from a bare environment (no `source scripts/env.sh`, none of the test suite's settings): a one-step
bf16 SFT run works, and its exports keep the training dtype (the run's own and `ds-rlhf export`; `--dtype fp32`
asks for fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from ds_rlhf.data.synthetic import write_addition_datasets
from ds_rlhf.entrypoints.main import runtime_env_defaults

ROOT = Path(__file__).resolve().parents[2]


def bare_env() -> dict:
    """What `env -i` leaves plus a PATH and HOME: no HF_*, DS_*, TOKENIZERS_*, PYTHON* settings."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}


def weights_dtype(model_dir: Path) -> tuple[set, str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118  safe_open is not iterable
    config = json.loads((model_dir / "config.json").read_text())
    return dtypes, config.get("dtype") or config.get("torch_dtype")


def test_runtime_defaults_fill_in_what_env_sh_set_and_keep_the_users(tmp_path):
    environ = {"TOKENIZERS_PARALLELISM": "true", "PYTHONDONTWRITEBYTECODE": "1"}
    runtime_env_defaults(environ, dev=tmp_path)  # a /dev without accelerators
    assert environ == {"TOKENIZERS_PARALLELISM": "true", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    (tmp_path / "nvidia0").touch()
    environ = {}
    runtime_env_defaults(environ, dev=tmp_path)
    assert "DS_ACCELERATOR" not in environ and environ["TOKENIZERS_PARALLELISM"] == "false"


def test_a_bf16_run_from_a_bare_environment_exports_bf16(tiny_model_path, tmp_path):
    store = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=4, n_sft=16, n_pref=4, seed=0,
                                    max_operand=9)["sft"]
    run = tmp_path / "run"

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "ds_rlhf.entrypoints", *args], capture_output=True, text=True,
                              timeout=400, cwd=ROOT, env=bare_env())

    proc = cli("train-sft", "--model.path", str(tiny_model_path), "--data.train", str(store), "--run.output_dir",
               str(run), "--run.steps", "1", "--optim.batch_size", "4", "--model.dtype", "bf16",
               "--data.eval_fraction", "0", "--run.progress", "false", "--run.tensorboard", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weights_dtype(run / "export") == ({torch.bfloat16}, "bfloat16")
    step = run / "checkpoints" / "step_00000001"
    assert cli("export", str(step), str(tmp_path / "auto")).returncode == 0
    assert weights_dtype(tmp_path / "auto") == ({torch.bfloat16}, "bfloat16")
    assert cli("export", str(step), str(tmp_path / "fp32"), "--dtype", "fp32").returncode == 0
    assert weights_dtype(tmp_path / "fp32") == ({torch.float32}, "float32")
