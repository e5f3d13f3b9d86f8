"""`ds-rlhf <command> [args...]`: one command for every entry point (each is also its own `ds-rlhf-<command>`).

A new subcommand is one row of `SUBCOMMANDS` (and, for its own console script, one line of pyproject.toml's
`[project.scripts]`). The target is imported only when its command runs, so `ds-rlhf --help` is instant.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ds_rlhf import __version__

# name -> ("module:function", one-line help). The function takes argv and returns an exit code (None means 0).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train-sft": ("ds_rlhf.entrypoints.train:main_sft", "supervised fine-tuning on an `sft` store (step 1)"),
    "train-rm": ("ds_rlhf.entrypoints.train:main_rm", "reward-model training on a `preference` store (step 2)"),
    "train-ppo": ("ds_rlhf.entrypoints.train:main_ppo", "RL (PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++) with vLLM "
                                                        "rollouts (step 3)"),
    "train-dpo": ("ds_rlhf.entrypoints.train:main_dpo", "DPO / IPO / SimPO-style training of the policy on a "
                                                        "`preference` store (instead of RM + RL)"),
    "pipeline": ("ds_rlhf.entrypoints.pipeline:main", "the tiny end-to-end demo: data -> SFT -> RM -> RL on one CPU"),
    "prep-prompts": ("ds_rlhf.entrypoints.prep:main_prompts", "RL prompts (verl parquet, OpenRLHF JSONL, ...) -> "
                                                              "prompt store"),
    "prep-gsm8k": ("ds_rlhf.entrypoints.prep:main_gsm8k", "GSM8K JSONL -> prompt store with ground truth, or SFT"),
    "prep-sft": ("ds_rlhf.entrypoints.prep:main_sft", "SFT demonstrations -> `sft` store with assistant-only masks"),
    "prep-preferences": ("ds_rlhf.entrypoints.prep:main_preferences", "chosen/rejected pairs (HH-RLHF, "
                                                                      "UltraFeedback) -> `preference` store"),
    "doctor": ("ds_rlhf.ops.doctor:main", "is this machine ready? versions vs the pinned set, GPUs, vLLM, "
                                            "DeepSpeed builds, I/O, NCCL"),
    "memory": ("ds_rlhf.ops.memory:main", "per-role memory plan of a config, before loading any weight"),
    "report": ("ds_rlhf.ops.report:main", "PNG plots and an HTML summary of a run directory"),
    "convert-gguf": ("ds_rlhf.entrypoints.convert:main", "a GGUF model file (llama.cpp, quantized) -> Hugging Face "
                                                         "safetensors directory with fixed-up special tokens"),
    "export": ("ds_rlhf.entrypoints.export:main", "a DeepSpeed checkpoint (any ZeRO stage, LoRA merged or as an "
                                                  "adapter) -> Hugging Face directory"),
    "serve-rm": ("ds_rlhf.entrypoints.serve_rm:main", "serve a reward model over HTTP for --reward.fn "
                                                      "http://host:port/score (several runs share one)"),
    "autotune": ("ds_rlhf.ops.autotune:main", "fastest micro-batch tokens / vLLM memory / async settings, "
                                                "measured with short trial runs within a time budget"),
    "bench": ("ds_rlhf.ops.bench:main", "run a bench/ benchmark (rollout, sync, rl-step, engines, data): "
                                              "a table and JSON"),
}

PROG = "ds-rlhf"
# /dev entries of an accelerator (NVIDIA, AMD ROCm, Intel): with none, DeepSpeed runs on the CPU
ACCELERATOR_DEVICES = ("nvidia[0-9]*", "kfd", "dri/renderD*")


def runtime_env_defaults(environ=os.environ, dev: Path = Path("/dev")) -> None:
    """What every command needs from the environment, set unless the user set it (so no `source scripts/env.sh`):
    no tokenizers thread pool forked into data loaders and reward workers, unbuffered output from this process and
    its children (logs under launchers and schedulers arrive as written), bytecode caching on for the processes it
    starts (reward workers, vLLM), and DeepSpeed's CPU accelerator on a machine without an accelerator device."""
    environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    environ.setdefault("PYTHONUNBUFFERED", "1")
    if environ is os.environ:
        sys.dont_write_bytecode = False
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if not any(any(dev.glob(pattern)) for pattern in ACCELERATOR_DEVICES):
        environ.setdefault("DS_ACCELERATOR", "cpu")


def usage() -> str:
    width = max(map(len, SUBCOMMANDS)) + 2
    rows = "\n".join(f"  {name:<{width}}{help_}" for name, (_, help_) in SUBCOMMANDS.items())
    return (f"usage: {PROG} <command> [args...]\n\n"
            "DeepSpeed-native RLHF: SFT -> reward model -> PPO/GRPO with vLLM rollouts.\n\n"
            f"commands:\n{rows}\n\n"
            f"Run `{PROG} <command> --help` for a command's options. Each command is also installed as its own\n"
            f"script, `{PROG}-<command>`; multi-GPU runs use the launch/ scripts with deepspeed or accelerate.\n")


def resolve(name: str) -> Callable[[list[str]], int | None]:
    """The function behind a subcommand (imported now)."""
    target = SUBCOMMANDS[name][0]
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def _command_hint(name: str, rest: list[str]) -> str:
    """' (did you mean `ds-rlhf train-rm ...`?)' for a command typed apart (`train rm`) or misspelled, else ''."""
    joined = f"{name}-{rest[0]}" if rest else ""
    if joined in SUBCOMMANDS:
        return f" (did you mean `{PROG} {joined}`?)"
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    return f" (did you mean `{PROG} {close[0]}`?)" if close else ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"{PROG} {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    runtime_env_defaults()
    if name not in SUBCOMMANDS:
        print(f"{PROG}: unknown command {name!r}{_command_hint(name, rest)}; run `{PROG} --help` for the list",
              file=sys.stderr)
        return 2
    try:
        return resolve(name)(rest) or 0
    except KeyboardInterrupt as exc:  # Ctrl-C while a command imports or starts: one line, exit 130
        if "--debug" in rest:
            raise
        print(f"error: {str(exc) or 'interrupted (Ctrl-C)'}", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
