"""`ds-rlhf doctor`: is this machine ready to train? One line per check: verdict (ok / warn / FAIL), what was
found, and the fix.

    ds-rlhf doctor                       # versions vs the pinned set, GPUs, interconnect, vLLM, DeepSpeed builds, ...
    ds-rlhf doctor --config run.yaml     # also what this run needs (vLLM for rollout.backend=vllm, CUDA for fp16, ...)
    ds-rlhf doctor --json                # a machine-readable list (the run report embeds it)

Without `--config` only problems that break every run are FAIL; `--config` turns the run's requirements into FAIL
lines (vLLM missing when `rollout.backend` is `vllm`, or `auto` on a GPU; CUDA missing when the dtype needs it; ...).
The exit status is 1 when any line is FAIL, 2 for a bad config, else 0. Nothing here loads a model or imports vLLM;
the probes take a few seconds at most.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ds_rlhf.config import parse_config
from ds_rlhf.errors import ConfigError
from ds_rlhf.run.checks import FAIL
from ds_rlhf.run.environment import apply_config, doctor_json, format_table, run_checks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-rlhf doctor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--config", help="the run's config (YAML/JSON, as the trainer takes it): its needs become FAIL")
    p.add_argument("--data-dir", default=".", help="directory whose filesystem to probe for io_uring / O_DIRECT "
                                                   "(default: the current directory)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON object instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = None
    if args.config:
        try:
            cfg = parse_config(["--config", args.config])
        except ConfigError as exc:
            print(f"ds-rlhf doctor: {exc}", file=sys.stderr)
            return 2
    start = time.perf_counter()
    results = run_checks(args.data_dir)
    if cfg is not None:
        results = apply_config(results, cfg)
    if args.json:
        print(json.dumps(doctor_json(results, time.perf_counter() - start), indent=1))
    else:
        print(format_table(results))
    return 1 if any(c.verdict == FAIL for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
