"""The command-line front of every entry point: --help, config parsing, clear one-line errors."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ds_rlhf.config import Config, ConfigError, apply_mapping, help_text, parse_config

USAGE = """
Settings: --config file.yaml|json, then --section.key value (or --key value when the key is unique).
Launch with `python`, `deepspeed` (e.g. deepspeed --num_gpus 8 launch/train_ppo.py --ds_config ...) or
`accelerate launch` (its DeepSpeed plugin settings fill in what you leave at defaults).
"""


def run_entry(doc: str, defaults: dict, run: Callable[[Config], object], argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        shown = Config()
        apply_mapping(shown, defaults)
        print(doc.strip() + "\n" + USAGE + "\nAll settings with this entry point's defaults:\n" + help_text(shown))
        return None
    from ds_rlhf.data.store import StoreFormatError, StoreMismatchError
    from ds_rlhf.rewards.scoring import BadRewardError
    from ds_rlhf.trainer.run_dir import RunDirError

    user_errors = (ConfigError, BadRewardError, RunDirError, StoreFormatError, StoreMismatchError)
    try:
        cfg = parse_config(argv, defaults)
        result = run(cfg)
    except user_errors as exc:  # bad settings, inputs, data stores or rewards: one line, no traceback
        sys.exit(f"error: {exc}")
    _shutdown_process_group()
    return result


def _shutdown_process_group() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo/NCCL helper threads can abort it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
