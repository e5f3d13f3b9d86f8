"""`ds-rlhf memory`: will this run fit? The per-role memory plan of a config, before any weight is loaded.

    ds-rlhf memory --config run.yaml                      # this machine's device (first GPU, else host RAM)
    ds-rlhf memory --config run.yaml --gpu-memory-gb 80   # plan for another card
    ds-rlhf memory --config run.yaml --world-size 8 --rollout.gpu_memory_utilization 0.4 --json

    ds-rlhf memory --config run.yaml --gpu-memory-gb 141 --run.max_gpu_memory_gb 48   # the split for a cap

Any trainer setting can follow as `--section.key value` (as for the trainer). With `--run.max_gpu_memory_gb` the
plan is for the cap (min(cap, device)), and an RL plan first shows the split of the cap the trainer would pick for
what the command line and the config leave unset (`memory/split.py`: vLLM's share, micro-batch tokens, sidecar
engines) and plans with it. Without a cap, an RL plan on a GPU sizes vLLM's KV cache by the work unless
`rollout.gpu_memory_utilization` or `rollout.kv_cache_gb` is given (`memory/engine_budget.py`: one `engines:` line
says the KV cache, why, and the share of the device it makes), and ends with the whole-device peak NVML would read
(`memory/device.py`: the plan plus the idle driver reserve, the trainer process's overhead and each sidecar
engine's bytes beyond its budget). On CPU the plan is for the host RAM and fits only when its peak also fits the memory
available now (other processes hold the rest); vLLM-CPU's KV cache is the one the run will ask for
(`memory/kv_cache.py`). The plan is per rank: parameters,
gradients, optimizer states (by ZeRO stage, offload and world size), activations of one micro-batch, the rollout
engine's weights and KV cache, and the device peak of the rollout and train phases against the device's memory.
Exit status: 0 when it fits, 1 when it does not, 2 for a bad config. How it is computed: `memory/plan.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ds_rlhf.config import parse_config
from ds_rlhf.errors import ConfigError
from ds_rlhf.memory.cap import capped_total
from ds_rlhf.memory.device import DevicePeak, device_peak
from ds_rlhf.memory.engine_budget import apply_engine_budget, choose_engine_budget
from ds_rlhf.memory.kv_cache import available_host_bytes
from ds_rlhf.memory.plan import GiB, MemoryPlan, fmt_bytes, plan_memory
from ds_rlhf.memory.split import apply_split, choose_split

COLUMNS = (("weights", "params"), ("grads", "grads"), ("optim", "optimizer_states"), ("activ", "activations"),
           ("bucket", "buffers"), ("KV", "kv_cache"), ("device", "device_total"), ("host", "host"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-rlhf memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", help="the run's config (YAML/JSON); default: the schema's defaults")
    p.add_argument("--kind", choices=("rl", "sft", "rm"), default="rl", help="which trainer the config is for")
    p.add_argument("--gpu-memory-gb", type=float, help="plan for a GPU of this many GiB (default: this machine's)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when --gpu-memory-gb is given or a GPU is visible")
    p.add_argument("--world-size", type=int, help="ranks (default: $WORLD_SIZE, else the visible GPUs, else 1)")
    p.add_argument("--reserve-gb", type=float, help="kept free per rank (default 2 on GPUs, 1 on CPU)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _host_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def target_device(args) -> tuple[str, int, str, int]:
    """(device, bytes per rank, device name, world size) from the arguments and this machine."""
    import torch

    local_gpu = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if args.gpu_memory_gb or local_gpu else "cpu")
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 0)) or (
        torch.cuda.device_count() if device == "cuda" and local_gpu else 1)
    if args.gpu_memory_gb:
        return device, int(args.gpu_memory_gb * GiB), f"{args.gpu_memory_gb:g} GiB GPU", world
    if device == "cuda":
        if not local_gpu:
            raise SystemExit("ds-rlhf memory: --device cuda without a visible GPU needs --gpu-memory-gb")
        props = torch.cuda.get_device_properties(0)
        return device, int(props.total_memory), props.name, world
    return device, _host_ram() // world, f"host RAM / {world} rank(s)", world


def format_plan(plan: MemoryPlan) -> str:
    s = plan.settings
    zero = f"ZeRO-{s.zero_stage}" + (" + optimizer offload" if s.offload_optimizer else "") + (
        " + weight offload" if s.offload_param else "")
    rollout = s.rollout
    if s.rollout != "none":
        rollout += f" {s.placement}" + (", sleeps while training" if s.sleep and s.device == "cuda"
                                          and s.placement == "colocated" else "")
        if s.rollout_precision != s.precision:
            rollout += f", engines in {s.rollout_precision} (rollout.dtype)"
    head = (f"memory plan ({s.kind}) per rank: {s.world_size} rank(s) on {s.device} ({s.device_name}, "
            f"{fmt_bytes(s.capacity)}), {s.precision}, {zero}, {s.optimizer}, micro-batch {s.tokens} tokens "
            f"(sequences of {s.seq_len}), gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, "
            f"rollout {rollout}")
    rows = [["role", "#params", *[c for c, _ in COLUMNS], "notes"]]
    for r in plan.roles:
        values = {**{k: getattr(r, k) for _, k in COLUMNS}}
        rows.append([r.role, f"{r.num_params / 1e6:.1f}M", *[fmt_bytes(values[k]) if values[k] else "-"
                                                              for _, k in COLUMNS], r.detail])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [head, ""] + ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                          + "  " + row[-1] for row in rows]
    lines.append("")
    for phase, value in plan.phases.items():
        lines.append(f"{phase:>8} phase peak: {fmt_bytes(value)} + reserve {fmt_bytes(s.reserve)} = "
                     f"{fmt_bytes(value + s.reserve)} of {fmt_bytes(s.capacity)}")
    if plan.host_per_rank:
        lines.append(f"host memory per rank: {fmt_bytes(plan.host_per_rank)} (x ranks per node)")
    lines += [f"note: {n}" for n in plan.notes]
    headroom = s.capacity - plan.peak - s.reserve
    lines.append(f"\n{'FITS' if plan.fits else 'DOES NOT FIT'}: peak {fmt_bytes(plan.peak)} ("
                 f"{max(plan.phases, key=plan.phases.get)} phase), headroom {fmt_bytes(headroom)}")
    return "\n".join(lines)


def check_available(plan: MemoryPlan, free: int) -> MemoryPlan:
    """A CPU plan that fits the host RAM but not the `free` bytes per rank available now does not fit."""
    if plan.peak + plan.settings.reserve <= free:
        return plan
    note = (f"this machine has {fmt_bytes(free)} per rank available now (other processes hold the rest of the RAM): "
            f"the peak plus reserve ({fmt_bytes(plan.peak + plan.settings.reserve)}) does not fit it")
    return dataclasses.replace(plan, fits=False, notes=(*plan.notes, note))


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)

    try:
        cfg = parse_config((["--config", args.config] if args.config else []) + rest)
        device, capacity, name, world = target_device(args)
        reserve = None if args.reserve_gb is None else int(args.reserve_gb * GiB)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ds-rlhf memory: {exc}", file=sys.stderr)
        return 2
    split = None
    if cfg.run.max_gpu_memory_gb > 0 and device == "cuda":
        name = f"{name}, run.max_gpu_memory_gb={cfg.run.max_gpu_memory_gb:g}"
        try:
            split = choose_split(cfg, capacity, world_size=world) if args.kind == "rl" else None
        except ConfigError as exc:  # no split fits the cap
            print(f"ds-rlhf memory: {exc}", file=sys.stderr)
            return 1
        except (ValueError, FileNotFoundError) as exc:
            print(f"ds-rlhf memory: {exc}", file=sys.stderr)
            return 2
        if split is not None:
            apply_split(cfg, split)
        capacity = capped_total(cfg, capacity)
    try:
        budget = (choose_engine_budget(cfg, capacity, world_size=world)
                  if args.kind == "rl" and device == "cuda" else None)
        if budget is not None:
            apply_engine_budget(cfg, budget)
        plan = plan_memory(cfg, kind=args.kind, device=device, capacity=capacity, device_name=name,
                           world_size=world, reserve=reserve)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"ds-rlhf memory: {exc}", file=sys.stderr)
        return 2
    if device == "cpu" and not args.gpu_memory_gb:
        plan = check_available(plan, available_host_bytes() // world)
    peak = device_peak(cfg, plan) if device == "cuda" and args.kind == "rl" else None
    if args.json:
        print(json.dumps({**plan.to_dict(), "split": split.to_dict() if split else None,
                          "engine_budget": budget.to_dict() if budget else None,
                          "device_peak": peak.to_dict() if peak else None}, indent=1))
    else:
        print((f"split: {split.line(cfg.run.max_gpu_memory_gb, args.kind)}\n\n" if split else "")
              + (f"engines: {budget.line().removeprefix('[rl] ')}\n\n" if budget else "") + format_plan(plan)
              + (f"\n{format_device_peak(peak)}" if peak else ""))
    return 0 if plan.fits else 1


def format_device_peak(peak: DevicePeak) -> str:
    """The whole-device peak as NVML would read it (`memory/device.py`), one line."""
    return (f"device peak estimate (NVML, whole device): {fmt_bytes(peak.total)} in the {peak.phase} phase = plan "
            f"{fmt_bytes(peak.plan)} + idle {fmt_bytes(peak.baseline)} + trainer process {fmt_bytes(peak.trainer)}"
            + (f" + engines beyond their budget {fmt_bytes(peak.engines)}" if peak.engines else ""))


if __name__ == "__main__":
    sys.exit(main())
