"""The loops' operator hooks on real tiny runs (HF generate backend, CPU): environment.json at start, status.json at
exit (finished / failed), time/data, health/warnings, completions/s, and the live endpoint scraped mid-run."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ds_rlhf.config import parse_config
from ds_rlhf.distributed import free_port
from ds_rlhf.telemetry.logger import read_metrics


@pytest.fixture(scope="module")
def small_stores(tiny_model_path, tmp_path_factory):
    from ds_rlhf.data.synthetic import write_addition_datasets

    return write_addition_datasets(tmp_path_factory.mktemp("hooks_data"), tiny_model_path, n_prompts=64, n_sft=64,
                                   n_pref=8, max_operand=20)


def rl_argv(out, stores, steps=3, *extra):
    return ["--model.path", "tiny", "--data.train", str(stores["prompts"]), "--rollout.backend", "hf",
            "--run.output_dir", str(out), "--run.steps", str(steps), "--reward.fn", "math_shaped",
            "--rl.prompts_per_step", "4", "--rollout.n_samples", "2", "--rollout.max_new_tokens", "8",
            "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false", *extra]


def test_rl_run_writes_environment_and_status_and_serves_live_metrics(small_stores, dist_single, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    port = free_port()
    trainer = RLTrainer(parse_config(rl_argv(tmp_path, small_stores, 3, "--run.metrics_port", str(port))))
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "running"
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env["checks"] and env["seconds"] < 5
    scraped, after_step = [], trainer.monitor.after_step

    def scrape_after(step, metrics):
        out = after_step(step, metrics)
        scraped.append((out, urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()))
        return out

    trainer.monitor.after_step = scrape_after
    history = trainer.train()
    assert len(history) == 3 and len(scraped) == 3
    metrics, text = scraped[-1]
    assert "ds_rlhf_step 3.0" in text and f"ds_rlhf_reward_mean {metrics['reward/mean']!r}" in text
    assert f"ds_rlhf_rollout_staleness {metrics['rollout/staleness']!r}" in text
    assert 'ds_rlhf_phase_seconds{phase="data"}' in text and 'ds_rlhf_phase_seconds{phase="rollout"}' in text
    for record in read_metrics(tmp_path):
        assert record["time/data"] > 0 and record["health/warnings"] >= 0
        assert record["time/step"] == pytest.approx(sum(v for k, v in record.items() if k.startswith("time/")
                                                        and k not in ("time/step", "time/wall")))
        assert record["throughput/completions_per_s"] > 0
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 3 and status["exit_code"] == 0
    with pytest.raises(OSError):  # the endpoint stopped with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_rl_run_that_fails_says_so_in_status_json(small_stores, dist_single, tmp_path):
    from ds_rlhf.recipes.rl import RLTrainer

    trainer = RLTrainer(parse_config(rl_argv(tmp_path, small_stores, 3)))
    train_step = trainer.train_step

    def fail_second():
        if trainer.step == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (a test)")
        return train_step()

    trainer.train_step = fail_second
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 1
    assert status["error"]["type"] == "RuntimeError" and status["error"]["oom"]


def test_sft_run_times_data_and_writes_status(small_stores, dist_single, tmp_path):
    from ds_rlhf.recipes.sft import SFTTask
    from ds_rlhf.recipes.supervised import SupervisedTrainer

    cfg = parse_config(["--model.path", "tiny", "--data.train", str(small_stores["sft"]), "--run.output_dir",
                        str(tmp_path), "--run.steps", "2", "--optim.batch_size", "8", "--optim.micro_batch_size", "8",
                        "--run.progress", "false", "--run.tensorboard", "false", "--run.export_hf", "false"])
    SupervisedTrainer(cfg, SFTTask()).train()
    records = [r for r in read_metrics(tmp_path) if "time/wall" in r]
    assert len(records) == 2 and all(r["time/data"] > 0 and "health/warnings" in r for r in records)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "finished" and status["kind"] == "sft" and status["step"] == 2
    assert (tmp_path / "environment.json").is_file()


def test_sigterm_stop_is_recorded_in_status_json(small_stores, tmp_path):
    """A user's SIGTERM: the step finishes, a checkpoint is saved, exit 143, and status.json says stopped."""
    import signal
    import subprocess
    import sys
    import time

    from ds_rlhf.testing.multiproc import clean_env

    out = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ds_rlhf.entrypoints", "train-ppo",
                                 *rl_argv(out, small_stores, 500)], stdout=log, stderr=subprocess.STDOUT,
                                env=clean_env(PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(240) == 128 + signal.SIGTERM, (tmp_path / "log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "stopped" and status["signal"] == "SIGTERM" and 1 <= status["step"] < 500


@pytest.mark.parametrize("when", ["final_save", "shutdown"])
def test_signal_after_the_last_step_still_exits_143_with_the_final_checkpoint(small_stores, dist_single, tmp_path,
                                                                              when):
    """A SIGTERM that lands after the last step (during the final save, or while vLLM and the loggers shut down)
    is handled like one during training: exit 143 with the final checkpoint, not the default handler's death by -15
    mid-save."""
    import signal

    from ds_rlhf.recipes.rl import RLTrainer

    trainer = RLTrainer(parse_config(rl_argv(tmp_path, small_stores, 2)))
    before = signal.getsignal(signal.SIGTERM)

    def deliver_sigterm():  # what the kernel does on a real signal: call the handler installed for it
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler) and handler not in (signal.SIG_DFL, signal.SIG_IGN), handler
        handler(signal.SIGTERM, None)

    save, close = trainer._save, trainer.parts.close
    trainer._save = lambda: (deliver_sigterm() if when == "final_save" and trainer.step == 2 else None, save())
    trainer.parts.close = lambda: (deliver_sigterm() if when == "shutdown" else None, close())
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["step"] == 2
    assert status["status"] == ("stopped" if when == "final_save" else "finished")
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back
