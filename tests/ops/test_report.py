"""`ds-rlhf report`: plots and HTML from a finished, a running (torn last line) and a crashed run directory."""

from __future__ import annotations

import json
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ds_rlhf.entrypoints.main import main as umbrella
from ds_rlhf.ops.report import load_run, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(step: int) -> dict:
    phases = {"time/rollout": 2.0 + 0.01 * step, "time/reward": 0.05, "time/old_logp": 0.0, "time/train": 1.0,
              "time/sync": 0.2}
    return {"step": step, "time": 1.7e9 + 4 * step, "reward/mean": 0.3 + 0.01 * step, "reward/exact_match": 0.02,
            "kl/mean": 0.001 * step, "kl/coef": 0.05, "actor/entropy": 2.0 - 0.01 * step,
            "response/len_mean": 20.0 + step, "response/len_max": 32.0,
            "mismatch/kl_rollout_trainer": "nan" if step == 3 else 1e-6, **phases,
            "time/step": sum(phases.values()), "time/wall": sum(phases.values()) + 0.1,
            "throughput/tokens_per_s": 1000.0, "sys/gpu_util_pct": 85.0, "sys/gpu_mem_used_gb": 40.0,
            "sys/gpu_mem_peak_gb": 45.0}


def make_run(root: Path, steps: int, planned: int, *, torn: bool = False, checkpoints=()) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"run": {"steps": planned, "output_dir": str(root)},
                                                  "rl": {"algo": "grpo"}, "model": {"path": "tiny"}}))
    text = "".join(json.dumps(_record(s)) + "\n" for s in range(1, steps + 1))
    if torn:
        text += json.dumps(_record(steps + 1))[:57]  # the writer died (or is) mid-line
    (root / "metrics.jsonl").write_text(text)
    for step in checkpoints:
        path = root / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / "COMPLETE").write_text("ok\n")
    return root


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])


def check_page(page: Path) -> list[Path]:
    """Every <img> of the page points to an existing, valid, non-empty PNG; returns them."""
    from PIL import Image

    parser = _Links()
    parser.feed(page.read_text())
    assert parser.images, "no plots in the page"
    files = [page.parent / src for src in parser.images]
    for path in files:
        assert path.is_file() and path.stat().st_size > 1000, path
        assert path.read_bytes()[:8] == PNG_MAGIC, path
        with Image.open(path) as img:
            img.verify()
    return files


def test_finished_run(tmp_path):
    run = make_run(tmp_path / "done", steps=12, planned=12, checkpoints=(6, 12))
    page = write_report(run, run_doctor=False)
    assert page == run / "report" / "index.html"
    names = {p.name for p in check_page(page)}
    assert {"reward.png", "kl.png", "entropy.png", "response_length.png", "phases.png", "gpu.png"} <= names
    html = page.read_text()
    assert "finished: 12 steps" in html and "reward/mean" in html and "grpo" in html
    assert "<td>reward/mean</td><td>0.33</td><td>0.4</td><td>0.42</td>" in html  # first 5, last 5, final


def test_running_run_with_a_torn_last_line(tmp_path):
    run = make_run(tmp_path / "live", steps=5, planned=100, torn=True, checkpoints=(2,))
    (run / ".lock").write_text(f"pid={os.getpid()}\nhost={os.uname().nodename}\nstarted=now\n")
    info = load_run(run)
    assert len(info.records) == 5 and info.status.startswith("running (pid")
    assert any("torn last line" in w for w in info.skipped_lines)
    page = write_report(run, tmp_path / "elsewhere", run_doctor=False)
    check_page(page)
    assert "running" in page.read_text() and not (run / "report").exists()


def test_crashed_run_and_a_run_with_nothing_yet(tmp_path):
    run = make_run(tmp_path / "dead", steps=7, planned=20, checkpoints=(5,))
    (run / ".lock").write_text("pid=999999999\nhost=somewhere-else\n")
    check_page(write_report(run, run_doctor=False))
    status = load_run(run).status
    assert "stopped at step 7 of 20" in status and "last checkpoint at step 5" in status
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".lock").write_text("pid=999999999\nhost=somewhere-else\n")  # a run that had just claimed its directory
    page = write_report(empty, run_doctor=False)
    text = page.read_text()
    assert "no metrics recorded yet" in text and "nothing to plot yet" in text and "no config.json" in text


def test_environment_from_the_run_or_the_doctor(tmp_path):
    run = make_run(tmp_path / "env", steps=3, planned=3, checkpoints=(3,))
    env = {"checks": [{"name": "GPUs", "verdict": "ok", "found": "8 x H200 (from the run)", "fix": ""}]}
    (run / "environment.json").write_text(json.dumps(env))
    assert "8 x H200 (from the run)" in write_report(run).read_text()
    (run / "environment.json").unlink()
    text = write_report(run).read_text()  # no file: the doctor runs here, now
    assert "ds-rlhf doctor on" in text and "core packages" in text


def test_cli(tmp_path, capsys):
    run = make_run(tmp_path / "cli", steps=4, planned=4)
    assert umbrella(["report", str(run), "--no-doctor"]) == 0
    assert Path(capsys.readouterr().out.strip()).is_file()
    assert umbrella(["report", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("bad", ["{not json}\n{}\n"])
def test_a_bad_line_in_the_middle_is_an_error(tmp_path, bad):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_record(1)) + "\n" + bad)
    with pytest.raises(ValueError, match="line 2"):
        write_report(tmp_path, run_doctor=False)
