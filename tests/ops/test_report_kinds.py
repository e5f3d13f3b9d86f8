"""The report of each kind of run (RL, SFT, RM, DPO) has that kind's plots, each drawn in headless Chromium.

The run directories are written here with the trainer's own writers (`MetricsLogger`, `SampleLogger`) and the keys
each recipe logs; the page is then opened in Chromium (`--dump-dom` of a copy of the page with a script that reads
every plot's `naturalWidth`, i.e. the browser decoded the image). Chromium comes from Debian's
`chromium-headless-shell` (or `chromium`); the browser test is skipped, with that said, on a machine without it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ds_rlhf.ops.report import write_report
from ds_rlhf.ops.report_plots import present_keys
from ds_rlhf.ops.report_sections import group_health
from ds_rlhf.run.health import HealthWarning
from ds_rlhf.telemetry import MetricsLogger
from ds_rlhf.telemetry.samples import SampleLogger
from tests.ops.test_report import check_page

STEPS = 8
EXPECTED = {
    "rl": {"reward", "eval", "kl", "entropy", "response_length", "throughput", "phases"},
    "sft": {"loss", "perplexity"},
    "rm": {"loss", "accuracy", "margin"},
    "dpo": {"loss", "accuracy", "margin", "dpo_rewards"},
}
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PROBE = ("<script>window.addEventListener('load',()=>{const r=[...document.querySelectorAll('.plots img')].map("
         "i=>({src:i.getAttribute('src'),width:i.naturalWidth,height:i.naturalHeight}));const p=document."
         "createElement('pre');p.id='probe';p.textContent=JSON.stringify(r);document.body.appendChild(p);});</script>")


def _step_metrics(kind: str, step: int) -> dict:
    t = step / STEPS
    timing = {"time/train": 1.0, "time/data": 0.01, "time/wall": 1.1, "sys/cpu_max_rss_gb": 2.0}
    if kind == "rl":
        return {"reward/mean": 0.2 + 0.5 * t, "reward/std": 0.3, "reward/exact_match": 0.1 + 0.4 * t,
                "reward/frac_zero_std": 0.2, "kl/mean": 0.01 * step, "kl/coef": 0.05, "actor/entropy": 2.0 - t,
                "response/len_mean": 20 + step, "response/len_max": 32.0, "mismatch/kl_rollout_trainer": 1e-6,
                "time/rollout": 2.0, "time/sync": 0.2, "throughput/tokens_per_s": 900.0 + step, **timing}
    if kind == "sft":
        return {"train/loss": 2.0 * math.exp(-t), "train/lr": 1e-4, **timing}
    if kind == "rm":
        return {"train/loss": 0.7 - 0.3 * t, "train/accuracy": 0.5 + 0.3 * t, "train/margin": 0.1 + t, **timing}
    return {"dpo/loss": 0.69 - 0.3 * t, "rewards/chosen": 0.2 * t, "rewards/rejected": -0.2 * t,
            "rewards/margin": 0.4 * t, "rewards/accuracy": 0.5 + 0.4 * t, **timing}


def _eval_metrics(kind: str, step: int) -> dict:
    t = step / STEPS
    if kind == "rl":
        return {"eval/pass@1": 0.1 + 0.5 * t, "eval/reward_mean": 0.2 + 0.5 * t, "eval/response_len_mean": 24.0,
                "eval/prompts": 16.0, "eval/samples": 16.0}
    if kind == "sft":
        return {"eval/loss": 2.1 * math.exp(-t), "eval/perplexity": math.exp(2.1 * math.exp(-t))}
    if kind == "rm":
        return {"eval/loss": 0.7 - 0.2 * t, "eval/accuracy": 0.5 + 0.25 * t}
    return {"eval/loss": 0.69 - 0.2 * t, "eval/rewards/chosen": 0.1 * t, "eval/rewards/rejected": -0.1 * t,
            "eval/rewards/margin": 0.2 * t, "eval/rewards/accuracy": 0.5 + 0.3 * t}


def make_kind_run(root: Path, kind: str) -> Path:
    """A finished run of `kind` as the trainer leaves it: config.json, metrics.jsonl (an evaluation every 4 steps;
    RL also before training, the others a `final/` one after the last step), samples.jsonl (RL), status.json."""
    root.mkdir(parents=True)
    config = {"run": {"steps": STEPS, "output_dir": str(root)}, "model": {"path": "tiny"}}
    if kind == "rl":
        config["rl"], config["reward"] = {"algo": "grpo"}, {"fn": "math_shaped"}
    (root / "config.json").write_text(json.dumps(config))
    logger = MetricsLogger(root, total_steps=STEPS, tensorboard=False, progress=False, desc=kind)
    samples = SampleLogger(root, 0, every=4, k=2) if kind == "rl" else None
    if kind == "rl":
        logger.log(0, _eval_metrics(kind, 0))
    for step in range(1, STEPS + 1):
        logger.log(step, {**_step_metrics(kind, step), **(_eval_metrics(kind, step) if step % 4 == 0 else {})})
        if samples is not None:
            samples.maybe_log(step, [{"prompt": f"What is {step} + {i}?", "response": f"#### {step + i}",
                                      "reward": 1.0, "reward_components": {"math_shaped": 1.0},
                                      "ground_truth": str(step + i), "advantage": 0.5, "weights_version": step - 1,
                                      "prompt_index": i} for i in range(3)])
    if kind != "rl":
        logger.log(STEPS, {f"final/{k}": v for k, v in _eval_metrics(kind, STEPS).items()})
    logger.close()
    if samples is not None:
        samples.close()
    (root / "status.json").write_text(json.dumps({"status": "finished", "step": STEPS, "kind": kind}))
    return root


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return {kind: write_report(make_kind_run(root / kind, kind), run_doctor=False) for kind in EXPECTED}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_kind_of_run_gets_its_plots(reports, kind):
    page = reports[kind]
    names = {p.stem for p in check_page(page)}
    assert EXPECTED[kind] <= names, f"{kind}: missing {sorted(EXPECTED[kind] - names)}"
    text = page.read_text()
    assert "finished: 8 steps" in text and "no health warnings" in text
    if kind == "rl":  # the samples with their rewards, and the held-out evaluation in the metrics table
        assert "<h2>Samples</h2>" in text and "What is 8 + 1?" in text and "math_shaped=1" in text
        assert "<td>eval/pass@1</td>" in text
    else:
        assert "<h2>Samples</h2>" not in text
    loss = {"sft": "train/loss", "rm": "train/loss", "dpo": "dpo/loss"}.get(kind)
    if loss:
        assert f"<td>{loss}</td>" in text and "<td>eval/loss</td>" in text


def test_final_and_pattern_keys_join_their_plots():
    records = [{"step": 1, "eval/pass@1": 0.1, "eval/pass@8": 0.5, "eval/gsm8k/pass@1": 0.2},
               {"step": 2, "final/eval/loss": 1.0, "eval/loss": 1.2}]
    assert present_keys(records, ("eval/pass@*", "eval/reward_mean")) == ["eval/pass@1", "eval/pass@8"]
    assert present_keys(records, ("eval/loss", "final/eval/loss")) == ["eval/loss", "final/eval/loss"]


def test_health_lines_are_grouped_by_kind_with_count_and_steps():
    slow = [HealthWarning("step_time", s, 5.0, 2.0, "rollout", f"step {s} took 5.00s") for s in (6, 7, 8, 12)]
    found = slow[:3] + [HealthWarning("gpu_util", 9, 20.0, 70.0, "", "step 9: GPU utilisation 20%")] + slow[3:]
    groups = group_health(found)
    assert [g.line() for g in groups] == ["step_time: 4 times, steps 6-12; last: step 12 took 5.00s",
                                          "gpu_util: once, step 9; last: step 9: GPU utilisation 20%"]


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def drawn_in_browser(page: Path, browser: str) -> dict[str, tuple[int, int]]:
    """{plot file stem: (naturalWidth, naturalHeight)} of every plot of the page as headless Chromium loaded it."""
    probe = page.with_name("_probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    try:
        out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                              "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                             capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    found = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.S)
    assert found, f"the browser printed no probe result (exit {out.returncode}): {out.stderr[-2000:]}"
    return {Path(i["src"]).stem: (i["width"], i["height"]) for i in json.loads(found.group(1))}


def test_each_plot_is_drawn_in_headless_chromium(reports):
    browser = _browser()
    if browser is None:
        pytest.skip("no headless Chromium here (apt-get install chromium-headless-shell); "
                    "test_each_kind_of_run_gets_its_plots checks the HTML and PNG files")
    for kind, page in reports.items():
        drawn = drawn_in_browser(page, browser)
        missing = sorted(name for name in EXPECTED[kind] if drawn.get(name, (0, 0))[0] <= 0)
        assert not missing, f"{kind}: plots not drawn in the browser: {missing} (drawn: {drawn})"
        assert all(w > 100 and h > 100 for w, h in drawn.values()), drawn
