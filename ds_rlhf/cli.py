"""The command-line front of every entry point: --help, config parsing, clear one-line errors.

An error the user can fix by changing an input (`USER_ERRORS`: `config.UserInputError` and its subclasses such as
`ConfigError`, and the data, run-directory and reward errors) ends the command with one `error: ...` line and exit
status 1; any other exception is a bug and shows its traceback. `--debug` (or DS_RLHF_DEBUG=1) shows the traceback of
user errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ds_rlhf.config import Config, UserInputError, apply_mapping, help_text, parse_config
from ds_rlhf.data.formats import DataPrepError
from ds_rlhf.data.store import StoreFormatError, StoreMismatchError
from ds_rlhf.rewards.scoring import BadRewardError
from ds_rlhf.trainer.run_dir import RunDirError

USAGE = """
Settings: --config file.yaml|json, then --section.key value (or --key value when the key is unique).
Launch with `python`, `deepspeed` (e.g. deepspeed --num_gpus 8 launch/train_ppo.py --ds_config ...) or
`accelerate launch` (its DeepSpeed plugin settings fill in what you leave at defaults).
A mistake in the settings or inputs is one `error: ...` line; --debug (or DS_RLHF_DEBUG=1) shows its traceback.
"""
DEBUG_FLAG, DEBUG_ENV = "--debug", "DS_RLHF_DEBUG"
# Errors a user causes and fixes by changing one input; each message names that input.
USER_ERRORS = (UserInputError, DataPrepError, StoreFormatError, StoreMismatchError, BadRewardError, RunDirError)


def debug_requested(argv: list[str]) -> bool:
    """Whether user errors should show their traceback: `--debug` on the command line or DS_RLHF_DEBUG set (not 0)."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def run_entry(doc: str, defaults: dict, run: Callable[[Config], object], argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        shown = Config()
        apply_mapping(shown, defaults)
        print(doc.strip() + "\n" + USAGE + "\nAll settings with this entry point's defaults:\n" + help_text(shown))
        return None
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        cfg = parse_config(argv, defaults)
        result = run(cfg)
    except USER_ERRORS as exc:  # bad settings, inputs or rewards: one line, no traceback
        if debug:
            raise
        sys.exit(f"error: {exc}")
    _shutdown_process_group()
    return result


def _shutdown_process_group() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo/NCCL helper threads can abort it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
