"""A reward module that hangs at import: a progress line after a few seconds names it, and after
reward.import_timeout the run stops with one error line naming the module and that setting."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ds_rlhf.testing.multiproc import clean_env
from tests.recipes.stores import prompt_store

ROOT = Path(__file__).resolve().parents[2]


def test_a_reward_module_that_hangs_at_import_is_named_and_times_out(tiny_model_path, tmp_path):
    sleepy = tmp_path / "sleepy_reward.py"
    sleepy.write_text("import time\ntime.sleep(600)\n\n\ndef score(prompt, completion, **kw):\n    return 0.0\n")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", "--model.path", str(tiny_model_path),
         "--data.train", str(prompt_store(tmp_path, tiny_model_path)), "--reward.fn", f"{sleepy}:score",
         "--reward.import_timeout", "9", "--run.output_dir", str(tmp_path / "run"), "--rollout.backend", "hf",
         "--run.steps", "1", "--run.progress", "false", "--run.tensorboard", "false"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=clean_env())
    seconds = time.monotonic() - start
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    note = [line for line in (proc.stdout + proc.stderr).splitlines() if "[reward] importing" in line]
    assert note == [f"[reward] importing reward module(s) {sleepy} ... (waiting up to 9s, reward.import_timeout)"]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: reward.fn='{sleepy}:score' cannot be loaded: "), last
    assert f"reward module(s) {sleepy} did not finish importing in 9s (reward.import_timeout)" in last, last
    assert seconds < 120  # the setting, not the 300 s default
