"""The full fine-tuning sweep of bench/low_memory_gpu.py (`--full-ft-sweep`): for each Llama shape, SFT with full
fine-tuning (no LoRA, no cap) at ZeRO-3 with and without CPU offload, each try screened by the planner first; the
largest shape that trains goes into the results as `full_ft_largest`."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from low_memory_machine import ROOT, child_env, host_ram_gib
from low_memory_model import RUN_SIZES, SHAPES, build_stores, ensure_model, params_of
from low_memory_phase import RECIPE, collect_plan, run_phase, start_plan
from low_memory_report import save

SWEEP_MODES = {  # mode -> overrides (full fine-tuning, no cap: the whole card)
    "plain": ["--offload", "false", "--ds_config", "ds_configs/zero3.json"],
    "offload": ["--offload", "true", "--ds_config", "ds_configs/low_memory_24g.json"],
}


def run_sweep(args, gpu: dict | None, results: dict) -> None:
    env = child_env(gpu is not None)
    workdir = Path(args.workdir)
    sizes = dict(RUN_SIZES["default"], **{k: getattr(args, k) for k in ("seq_len", "batch") if getattr(args, k)})
    sweep = results.setdefault("full_ft_sweep", {})
    card = gpu["memory_gib"] if gpu else None
    steps = args.sweep_steps
    for shape in [s.strip() for s in args.sweep_shapes.split(",") if s.strip()]:
        cfg_dir = workdir / f"config-{shape}"  # a config.json only: what the planner reads
        if not (cfg_dir / "config.json").exists():
            from transformers import LlamaConfig

            LlamaConfig(**SHAPES[shape]).save_pretrained(cfg_dir)
        tries, model, built = {}, None, False
        for mode in [m.strip() for m in args.sweep_modes.split(",") if m.strip()]:
            base = ["--config", str(ROOT / RECIPE), "--model.lora_rank", "0", "--model.share_base", "false",
                    "--run.max_gpu_memory_gb", "0", *SWEEP_MODES[mode], "--optim.batch_size", str(sizes["batch"]),
                    "--optim.micro_batch_size", str(sizes["batch"]), "--data.max_len", str(sizes["seq_len"]),
                    "--data.eval_fraction", "0", "--run.steps", str(steps), "--run.export_hf", "false",
                    "--run.overwrite", "true", "--run.progress", "false", "--run.tensorboard", "false",
                    "--run.log_every", "1", "--run.keep_last", "1", *shlex.split(args.extra)]
            plan = collect_plan(start_plan("sft", ["--model.path", str(cfg_dir), *base], 0, card or 141.0, env))
            host_ok = plan.get("host_gib", 0) <= host_ram_gib() * 0.9
            t = {"mode": mode, "plan": plan, "host_ram_gib": host_ram_gib(), "planned_fit": bool(plan.get("fits"))
                 and host_ok}
            if not t["planned_fit"] and not args.sweep_force:
                t["skipped"] = ("planner: " + ("device" if not plan.get("fits") else "host") + " memory does not fit")
                print(f"[low_memory] sweep {shape}/{mode}: skipped ({t['skipped']})", flush=True)
                tries[mode] = t
                continue
            if model is None:
                try:
                    model, info = ensure_model(args, shape, gpu is not None)
                    built = info["built"]
                except RuntimeError as exc:
                    t["skipped"] = str(exc)
                    tries[mode] = t
                    break
                stores = build_stores(workdir, model, sizes, steps)
            run_dir = workdir / "runs" / f"fullft-{shape}-{mode}"
            argv = ["--model.path", str(model), "--data.train", str(stores["sft"]), "--run.output_dir", str(run_dir),
                    *base]
            rec = {**run_phase(args, "sft", argv, run_dir, env, steps), "within_cap": None}  # no cap here
            # every step logged without running out of memory; a final checkpoint the disk cannot hold is noted only
            rec["trains"] = rec["steps_logged"] >= steps and rec["reason"] in (None, "disk (checkpoint)")
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # full-FT optimizer states: disk
            tries[mode] = {**t, **rec}
            sweep[shape] = {"params": params_of(SHAPES[shape]), "tries": tries}
            save(args, results)
        sweep[shape] = {"params": params_of(SHAPES[shape]), "tries": tries,
                        "trains": any(t.get("trains") for t in tries.values())}
        if built and not args.keep_models and shape != args.shape:
            shutil.rmtree(model, ignore_errors=True)
        save(args, results)
    fitting = [s for s, r in sweep.items() if r.get("trains")]
    results["full_ft_largest"] = max(fitting, key=lambda s: sweep[s]["params"]) if fitting else None
