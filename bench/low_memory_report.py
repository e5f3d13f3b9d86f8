"""The output of bench/low_memory_gpu.py: the accumulated results as low_memory.json (WORKDIR and OUT) and the
markdown table of every phase and sweep try recorded so far (for docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
from pathlib import Path


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(results: dict) -> str:
    m = results["machine"]
    gpu = m.get("gpu")
    hw = (f"{gpu['name']} ({gpu['memory_gib']:.0f} GiB), driver {gpu['driver']}" if gpu else "no GPU (CPU)") + (
        f", {m['cpus']} cores, {m['ram_gib']:.0f} GiB RAM")
    v = m["versions"]
    lines = [f"Low-memory benchmark (`bench/low_memory_gpu.py`), {results['date']}, commit {results.get('commit')}",
             "", f"- hardware: {hw}",
             "- software: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
             f"- command(s): {'; '.join(f'`{c}`' for c in results['commands'])}"]
    for key, run in results.get("runs", {}).items():
        s = run["sizes"]
        size = f"{run['params'] / 1e9:.2f}B parameters" if run.get("params") else "the offline tiny model"
        lines += ["", f"**{key}** ({size}, random init; cap "
                  f"{run['cap_gb']:g} GiB; SFT/RM {s['batch']} x {s['seq_len']} tokens per step; RL "
                  f"{s['prompts']} prompts x {s['samples']} samples, {s['prompt_len']} + {s['new_tokens']} tokens; "
                  f"reward {run['reward']}{'; extra ' + repr(run['extra']) if run['extra'] else ''})", "",
                  "| phase | exit | steps | step time (s, median) | wall (s) | NVML peak (GiB) | torch peak (GiB) | "
                  "host RSS peak (GiB) | <= cap | planned peak (GiB) | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in run["phases"].items():
            plan = r.get("plan") or {}
            note = r.get("reason") or ""
            if r.get("error_line") and r.get("reason"):
                note += ": " + r["error_line"][:160].replace("|", "/")
            if "exit" not in r:  # an earlier call ended mid-phase (run_phases' placeholder)
                lines.append(f"| {p} | - | - | - | - | - | - | - | - | - | {note} (started {r.get('started')}) |")
                continue
            lines.append(f"| {p} | {r['exit']} | {r['steps_logged']} | {fmt(r['step_time_s'])} | "
                         f"{fmt(r['wall_s'])} | {fmt(r['nvml_peak_gib'])} | {fmt(r['torch_peak_gib'])} | "
                         f"{fmt(r['host_rss_peak_gib'])} | {fmt(r['within_cap'])} | "
                         f"{fmt(plan.get('peak_gib'))} | {note} |")
    sweep = results.get("full_ft_sweep")
    if sweep:
        lines += ["", "**Full fine-tuning (no LoRA, no cap), SFT steps, ZeRO-3 plain / with offload**", "",
                  "| shape | params (B) | mode | planned device / host (GiB) | trains | step time (s) | "
                  "NVML peak (GiB) | host RSS peak (GiB) | note |", "|---|---|---|---|---|---|---|---|---|"]
        for shape, r in sweep.items():
            for mode, t in r["tries"].items():
                plan = t.get("plan") or {}
                note = t.get("skipped") or t.get("reason") or ""
                lines.append(f"| {shape} | {r['params'] / 1e9:.1f} | {mode} | {fmt(plan.get('peak_gib'))} / "
                             f"{fmt(plan.get('host_gib'))} | {fmt(t.get('trains'))} | {fmt(t.get('step_time_s'))}"
                             f" | {fmt(t.get('nvml_peak_gib'))} | {fmt(t.get('host_rss_peak_gib'))} | {note} |")
        lines += ["", f"Largest model that trains with full fine-tuning: {results.get('full_ft_largest') or 'none'}"]
    return "\n".join(lines)


def save(args, results: dict) -> None:
    text = json.dumps(results, indent=1, default=str)
    state = Path(args.workdir) / "low_memory.json"
    state.write_text(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "low_memory.json").write_text(text)
