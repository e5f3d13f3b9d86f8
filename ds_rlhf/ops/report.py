"""`ds-rlhf report RUN_DIR`: PNG plots and a one-page HTML summary of a run, finished, running or crashed.

    ds-rlhf report runs/grpo                  # -> runs/grpo/report/index.html (+ reward.png, kl.png, ...)
    ds-rlhf report runs/grpo --out /tmp/rep   # elsewhere (e.g. a read-only run directory)

It reads only what the run wrote: `metrics.jsonl` (through `telemetry.logger.read_metrics`, so a torn last line of a
run that is still writing, or died mid-write, is skipped), `samples.jsonl` (RL's sample rollouts), `config.json`,
the checkpoints' COMPLETE markers and the run lock, and `status.json` (how the trainer says the run ended). The
plots are those the run's metrics allow (`report_plots`: RL reward, held-out evaluation, KL, lengths; SFT loss; RM
and DPO loss, accuracy and margin). The environment section is `environment.json` / `doctor.json` from the run
directory when the trainer wrote one, else the doctor run now on this machine (`--no-doctor` skips it). The health
section replays `run.health` over the whole history, each kind of warning once with its count and steps.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ds_rlhf.atomic_files import write_text_atomic
from ds_rlhf.config_rl_names import in_sections
from ds_rlhf.ops.report_plots import render_plots, value
from ds_rlhf.ops.report_sections import curriculum_html, health_html, samples_html
from ds_rlhf.run.environment import doctor_json, run_checks
from ds_rlhf.run.health import replay
from ds_rlhf.run.monitor import read_status
from ds_rlhf.run.run_dir import LOCK_NAME, RUN_FILES, checkpoints_dir, complete_checkpoints, step_of
from ds_rlhf.telemetry.logger import read_metrics

ENV_FILES = ("environment.json", "doctor.json")
SUMMARY_KEYS = ("reward/mean", "reward/exact_match", "eval/pass@1", "eval/reward_mean", "kl/mean", "actor/entropy",
                "response/len_mean", "train/loss", "dpo/loss", "eval/loss", "train/accuracy", "eval/accuracy",
                "train/margin", "rewards/accuracy", "rewards/margin", "eval/rewards/accuracy",
                "eval/rewards/margin", "throughput/tokens_per_s", "time/wall", "mismatch/kl_rollout_trainer")


@dataclass
class RunInfo:
    run_dir: Path
    records: list[dict]
    config: dict = field(default_factory=dict)
    status: str = ""
    checkpoints: list[int] = field(default_factory=list)
    skipped_lines: list[str] = field(default_factory=list)  # warnings from reading metrics.jsonl


def _lock_holder(run_dir: Path) -> str:
    """'pid N' when the run lock names a live process on this host ('' when none, or it cannot be told)."""
    try:
        info = dict(line.split("=", 1) for line in (run_dir / LOCK_NAME).read_text().splitlines() if "=" in line)
    except OSError:
        return ""
    pid, host = info.get("pid", ""), info.get("host", "")
    if host != socket.gethostname() or not pid.isdigit():
        return ""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return f"pid {pid}"


def _from_status_file(run_dir: Path, last: int, ckpt: str) -> str:
    """The trainer's own word on how the run ended (`status.json`, written at exit), or '' when it left none."""
    status = read_status(run_dir) or {}
    step = status.get("step", last)
    if status.get("status") == "finished":
        return f"finished: {step} steps (status.json); {ckpt}"
    if status.get("status") == "stopped":
        return f"stopped by {status.get('signal', 'a signal')} at step {step} (status.json); {ckpt}"
    if status.get("status") == "failed":
        err = status.get("error", {})
        oom = " (out of memory)" if err.get("oom") else ""
        return f"failed at step {step}{oom}: {err.get('type', 'error')}: {err.get('message', '')}; {ckpt}"
    return ""


def run_status(run_dir: Path, records: list[dict], config: dict, checkpoints: list[int]) -> str:
    """finished / running / stopped / failed: from the lock (a live run), the trainer's `status.json` when it wrote
    one at exit, else from the last step, the planned steps and the checkpoints."""
    steps = [int(s) for r in records if (s := value(r, "step")) is not None and s == s]
    last = max(steps, default=0)
    planned = int(config.get("run", {}).get("steps", 0) or 0)
    final = bool(checkpoints) and checkpoints[-1] >= last > 0
    holder = _lock_holder(run_dir)
    of = f" of {planned}" if planned else ""
    if holder:
        age = time.time() - float(records[-1].get("time", time.time())) if records else 0.0
        return f"running ({holder}): step {last}{of}, last record {age:.0f}s ago"
    ckpt = f"last checkpoint at step {checkpoints[-1]}" if checkpoints else "no checkpoint"
    if said := _from_status_file(run_dir, last, ckpt):
        return said
    if planned and last >= planned and final:
        return f"finished: {last} steps, final checkpoint at step {checkpoints[-1]}"
    return f"stopped at step {last}{of} without a final checkpoint (crashed or killed?); {ckpt}"


def load_run(run_dir: str | Path) -> RunInfo:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    if not any((run_dir / name).exists() for name in RUN_FILES - {"report"}):
        raise ValueError(f"{run_dir} is not a run directory (no config.json, metrics.jsonl, status.json or "
                         "checkpoints in it): pass a run's --run.output_dir; nothing was written")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = read_metrics(run_dir)
    config = {}
    if (run_dir / "config.json").is_file():
        try:
            config = in_sections(json.loads((run_dir / "config.json").read_text()))
        except ValueError:
            config = {}
    checkpoints = [step_of(p) for p in complete_checkpoints(checkpoints_dir(run_dir))]
    info = RunInfo(run_dir, records, config, "", checkpoints, [str(w.message) for w in caught])
    info.status = run_status(run_dir, records, config, checkpoints)
    return info


def environment(run_dir: Path, run_doctor: bool) -> tuple[dict | None, str]:
    """(doctor JSON, where it came from)."""
    for name in ENV_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                return json.loads(path.read_text()), f"{name} in the run directory"
            except ValueError:
                continue
    if not run_doctor:
        return None, "not collected (--no-doctor)"

    return doctor_json(run_checks(run_dir)), f"ds-rlhf doctor on {socket.gethostname()} at report time"


# ---- HTML --------------------------------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:1.5em auto;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots figure{margin:0}.plots img{width:540px}
.samples td.text{white-space:pre-wrap;max-width:420px;font-family:monospace}
.ok{color:#1a7f37}.warn{color:#9a6700}.FAIL{color:#cf222e;font-weight:bold}.status{font-size:1.05em}
details{margin:.5em 0}pre{font-size:.8em;background:#f6f8fa;padding:.6em;overflow:auto}"""


def _esc(x) -> str:
    return html.escape(str(x))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def metrics_table(records: list[dict]) -> str:
    """Key metrics: first-5 mean, last-5 mean and the final value; then every metric of the last record."""
    rows = []
    for key in SUMMARY_KEYS:
        vals = [v for r in records if (v := value(r, key)) is not None and v == v]
        if vals:
            head, tail = vals[:5], vals[-5:]
            rows.append(f"<tr><td>{_esc(key)}</td><td>{_fmt(sum(head) / len(head))}</td>"
                        f"<td>{_fmt(sum(tail) / len(tail))}</td><td>{_fmt(vals[-1])}</td></tr>")
    out = ("<table><tr><th>metric</th><th>first 5 steps</th><th>last 5 steps</th><th>final</th></tr>"
           + "".join(rows) + "</table>") if rows else "<p>no metrics recorded yet</p>"
    if records:
        last = records[-1]
        cells = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(_fmt(v))}</td></tr>" for k, v in sorted(last.items()))
        out += f"<details><summary>all metrics of the last record</summary><table>{cells}</table></details>"
    return out


def environment_html(env: dict | None, source: str) -> str:
    if not env:
        return f"<p>environment: {_esc(source)}</p>"
    rows = "".join(f"<tr><td class='{_esc(c['verdict'])}'>{_esc(c['verdict'])}</td><td>{_esc(c['name'])}</td>"
                   f"<td>{_esc(c['found'])}</td><td>{_esc(c.get('fix', '') if c['verdict'] != 'ok' else '')}</td></tr>"
                   for c in env.get("checks", []))
    return f"<p>from {_esc(source)}</p><table>{rows}</table>"


def config_html(config: dict) -> str:
    if not config:
        return "<p>no config.json in the run directory</p>"
    brief = []
    for section, keys in (("model", ("path", "dtype")), ("rl", ("algo", "kl_coef")), ("reward", ("fn", "model")),
                          ("rollout", ("backend", "placement", "n_samples", "max_new_tokens")),
                          ("run", ("steps", "output_dir"))):
        for k in keys:
            if config.get(section, {}).get(k) not in (None, ""):
                brief.append(f"<tr><td>{section}.{k}</td><td>{_esc(config[section][k])}</td></tr>")
    full = _esc(json.dumps(config, indent=1, sort_keys=True))
    return f"<table>{''.join(brief)}</table><details><summary>full config</summary><pre>{full}</pre></details>"


def render_html(info: RunInfo, plots: list[tuple[str, Path]], env: dict | None, env_source: str,
                out_dir: Path) -> str:
    figures = "".join(f"<figure><img src='{_esc(p.relative_to(out_dir).as_posix())}' alt='{_esc(t)}'></figure>"
                      for t, p in plots)
    samples = samples_html(info.run_dir)
    notes = "".join(f"<p class='warn'>{_esc(s)}</p>" for s in info.skipped_lines)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>ds_rlhf run {_esc(info.run_dir.name)}</title>"
            f"<style>{CSS}</style></head><body><h1>ds_rlhf run report: {_esc(info.run_dir)}</h1>"
            f"<p class='status'>{_esc(info.status)}</p>{notes}"
            f"<p>{len(info.records)} records; generated {_esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>"
            f"<h2>Metrics</h2>{metrics_table(info.records)}{curriculum_html(info.records)}"
            f"<h2>Plots</h2><div class='plots'>{figures or '<p>nothing to plot yet</p>'}</div>"
            + (f"<h2>Samples</h2>{samples}" if samples else "")
            + f"<h2>Health</h2>{health_html(replay(info.records))}<h2>Config</h2>{config_html(info.config)}"
            f"<h2>Environment</h2>{environment_html(env, env_source)}</body></html>\n")


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, *, run_doctor: bool = True) -> Path:
    """Render the plots and `index.html` into `out_dir` (default `<run_dir>/report`); returns the HTML's path."""
    info = load_run(run_dir)
    out = Path(out_dir) if out_dir else info.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = render_plots(info.records, out)
    env, source = environment(info.run_dir, run_doctor)
    page = out / "index.html"
    # a browser reloading a running run's report never sees half a page
    write_text_atomic(page, render_html(info, plots, env, source, out))
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ds-rlhf report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("run_dir", help="the run's output directory (run.output_dir)")
    p.add_argument("--out", help="where to write the report (default: RUN_DIR/report)")
    p.add_argument("--no-doctor", action="store_true", help="skip the environment probes")
    args = p.parse_args(argv)
    try:
        page = write_report(args.run_dir, args.out, run_doctor=not args.no_doctor)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ds-rlhf report: error: {exc}", file=sys.stderr)
        return 2
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
