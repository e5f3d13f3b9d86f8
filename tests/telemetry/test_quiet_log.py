"""A quiet log: vLLM's per-call lines and long dumps filtered where vLLM writes them, one summary line per step,
the resolved config in config.json only, and a progress bar that other output does not tear."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ds_rlhf.rollout.vllm_logging import FILTER_CLASS, quiet_vllm_logging, with_quiet_filter
from ds_rlhf.telemetry import MetricsLogger
from ds_rlhf.telemetry.log_filters import MAX_CHARS, REPEAT_NOTE, QuietLogs
from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]
VLLM_PREFIX = re.compile(r"^\(\S+ pid=\d+\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d ")  # vLLM's "(proc pid=N) INFO date"
MAX_LINE = 400


def _quiet_logger(name: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(QuietLogs())
    logger = logging.getLogger(name)
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_the_filter_drops_per_call_lines_cuts_long_ones_and_limits_repeats():
    logger, stream = _quiet_logger("ds_rlhf_test.quiet")
    for _ in range(30):
        logger.info("Successfully reset prefix cache")
        logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    logger.info("Initializing a V1 LLM engine (v%s) with config: %s", "0.32.0", "model='m', " * 400)
    logger.info("step %d done", 1)
    logger.info("step %d done", 2)
    lines = stream.getvalue().splitlines()
    assert not any("prefix cache" in line for line in lines)
    threads = [line for line in lines if "torch.set_num_threads" in line]
    assert len(threads) == 2 and threads[1].endswith(REPEAT_NOTE) and not threads[0].endswith(REPEAT_NOTE)
    (config,) = [line for line in lines if "Initializing" in line]
    assert len(config) <= MAX_CHARS and "more characters not shown" in config
    assert lines[-2:] == ["step 1 done", "step 2 done"]


def test_vllms_own_logging_config_gets_the_filter(monkeypatch):
    """The file VLLM_LOGGING_CONFIG_PATH points at (what vLLM applies in each process it starts) has the filter on
    every handler, and this process's `vllm` handler has it now; a user's own logging config is left alone."""
    pytest.importorskip("vllm")
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    path = quiet_vllm_logging()
    assert path is not None and str(path) == os.environ["VLLM_LOGGING_CONFIG_PATH"]
    config = json.loads(path.read_text())
    assert all("ds_rlhf_quiet" in h["filters"] for h in config["handlers"].values())
    assert config["filters"]["ds_rlhf_quiet"] == {"()": FILTER_CLASS}
    assert any(isinstance(f, QuietLogs) for h in logging.getLogger("vllm").handlers for f in h.filters)
    assert quiet_vllm_logging() == path  # again: the same file
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/somewhere/my_logging.json")
    assert quiet_vllm_logging() is None
    assert with_quiet_filter({"handlers": {"h": {"filters": ["mine"]}}})["handlers"]["h"]["filters"] == [
        "mine", "ds_rlhf_quiet"]


def test_the_progress_bar_shows_full_names_and_other_output_goes_above_it(tmp_path, monkeypatch, capsys):
    from tqdm.contrib.logging import _TqdmLoggingHandler

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    library = logging.getLogger("ds_rlhf_test.library")
    plain = logging.StreamHandler(sys.stderr)
    library.handlers, library.propagate = [plain], False
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, desc="rl", postfix_keys=("reward/mean",))
    assert logger._bar is not None and logger.log_every == 0  # the bar is the per-step summary
    assert [type(h) for h in library.handlers] == [_TqdmLoggingHandler]  # writes through tqdm.write meanwhile
    logger.log(1, {"reward/mean": 0.25})
    library.warning("a library's line")
    logger.close()
    assert library.handlers == [plain]
    err = capsys.readouterr().err
    assert "reward/mean=0.25" in err and "\na library's line\n" in err.replace("\r", "\n")


def test_without_a_terminal_each_step_prints_one_summary_line(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, desc="sft", postfix_keys=("train/loss",))
    for step in (1, 2, 3):
        logger.log(step, {"train/loss": 1.0 / step})
    logger.close()
    assert capsys.readouterr().out.splitlines() == ["[sft] step 1/3  train/loss 1", "[sft] step 2/3  train/loss 0.5",
                                                    "[sft] step 3/3  train/loss 0.3333"]


def repeated_lines(text: str, most: int = 2) -> dict[str, int]:
    """Lines (vLLM's with their process, level and time prefix taken off) that occur more than `most` times."""
    counts = Counter(VLLM_PREFIX.sub(r"\1 ", line) for line in text.splitlines() if line.strip())
    return {line: n for line, n in counts.items() if n > most}


@pytest.mark.slow
def test_the_log_of_a_vllm_rl_run_is_quiet(tiny_model_path, tmp_path):
    """`train-ppo` on the vLLM backend, as the demo's RL step runs it (its output is not a terminal): no line
    repeated more than twice, none over 400 characters, one summary line per step, the config named, not dumped."""
    from ds_rlhf.data.synthetic import write_addition_datasets

    stores = write_addition_datasets(tmp_path / "data", tiny_model_path, n_prompts=32, n_sft=8, n_pref=8,
                                     max_operand=20)
    out = tmp_path / "rl"
    proc = subprocess.run(
        [sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo", "--model.path", str(tiny_model_path),
         "--data.train", str(stores["prompts"]), "--data.eval", str(stores["prompts"]), "--run.output_dir", str(out),
         "--run.steps", "3", "--rl.algo", "grpo", "--reward.fn", "math_shaped", "--rl.prompts_per_step", "4",
         "--rollout.n_samples", "4", "--rollout.max_new_tokens", "8", "--rollout.backend", "vllm",
         "--run.eval_every", "2", "--run.sample_log_every", "1", "--run.tensorboard", "false",
         "--run.export_hf", "false"],
        cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    log = proc.stdout
    assert proc.returncode == 0, log[-4000:]
    assert not repeated_lines(log), repeated_lines(log)
    long = [line[:200] for line in log.splitlines() if len(line) > MAX_LINE]
    assert not long, long
    assert [line.split("  ")[0] for line in log.splitlines() if line.startswith("[rl[grpo]] step")] == [
        "[rl[grpo]] step 1/3", "[rl[grpo]] step 2/3", "[rl[grpo]] step 3/3"]
    assert f"[rl] resolved config: {out / 'config.json'}" in log and '"kl_coef"' not in log
    assert json.loads((out / "config.json").read_text())["run"]["steps"] == 3
