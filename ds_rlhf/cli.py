"""The command-line front of every entry point: --help, config parsing, clear one-line errors.

An error the user can fix by changing an input (`USER_ERRORS`: `errors.UserInputError` and its subclasses such as
`ConfigError`, and the data, run-directory and reward errors) ends the command with one `error: ...` line and exit
status 1; any other exception is a bug and shows its traceback. `--debug` (or DS_RLHF_DEBUG=1) shows the traceback of
user errors too. A full disk, a read-only or unwritable path (an OSError naming its file) is one line as well, and so
is a Ctrl-C that lands outside the training loop (exit status 130; a trainer names the step and its checkpoint).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

from ds_rlhf.config import Config, apply_mapping, help_text, parse_config
from ds_rlhf.data.formats import DataPrepError
from ds_rlhf.data.store import StoreMismatchError
from ds_rlhf.data.store_checks import StoreFormatError
from ds_rlhf.entrypoints.main import runtime_env_defaults
from ds_rlhf.errors import UserInputError
from ds_rlhf.rewards.scoring import BadRewardError
from ds_rlhf.run.run_dir import RunDirError

USAGE = """
Settings: --config file.yaml|json, then --section.key value (or --key value when the key is unique).
Launch with `python`, `deepspeed` (e.g. deepspeed --num_gpus 8 launch/train_ppo.py --ds_config ...) or
`accelerate launch` (its DeepSpeed plugin settings fill in what you leave at defaults).
A mistake in the settings or inputs is one `error: ...` line; --debug (or DS_RLHF_DEBUG=1) shows its traceback.
"""
DEBUG_FLAG, DEBUG_ENV = "--debug", "DS_RLHF_DEBUG"
# Errors a user causes and fixes by changing one input; each message names that input.
USER_ERRORS = (UserInputError, DataPrepError, StoreFormatError, StoreMismatchError, BadRewardError, RunDirError)
# OSErrors of the machine rather than the code (a full disk or quota, a read-only or unwritable path, a file where a
# directory should be): one line naming the path, and what to do
PATH_ERRNOS = {errno.ENOSPC: "free space there or write elsewhere (e.g. --run.output_dir)",
               errno.EDQUOT: "free space there or write elsewhere (e.g. --run.output_dir)",
               errno.EROFS: "write elsewhere (e.g. --run.output_dir)",
               errno.EACCES: "fix its permissions or write elsewhere (e.g. --run.output_dir)",
               errno.EPERM: "fix its permissions or write elsewhere (e.g. --run.output_dir)",
               errno.ENOTDIR: "a file is in the way of a directory there"}
FULL = (errno.ENOSPC, errno.EDQUOT)


def path_error_line(exc: BaseException, output_dir: str | None = None) -> str | None:
    """One line for an OSError of the machine (see PATH_ERRNOS) naming its path, else None. A full disk met by a
    write (such errors carry no path) names the run's output directory, where the run writes."""
    if not isinstance(exc, OSError) or exc.errno not in PATH_ERRNOS:
        return None
    if exc.filename:
        return f"{exc.filename}: {exc.strerror}; {PATH_ERRNOS[exc.errno]}"
    if exc.errno in FULL and output_dir:
        return f"{exc.strerror or os.strerror(exc.errno)} (the run writes under run.output_dir={output_dir}); " \
               f"{PATH_ERRNOS[exc.errno]}"
    return None


def debug_requested(argv: list[str]) -> bool:
    """Whether user errors should show their traceback: `--debug` on the command line or DS_RLHF_DEBUG set (not 0)."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def run_entry(doc: str, defaults: dict, run: Callable[[Config], object], argv: list[str] | None = None,
              recipe: str | None = None):
    """Print --help, or parse the settings `recipe` (a `config_keys.RECIPES` name) reads and `run` them; a user
    error ends the command with one `error: ...` line."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        shown = Config()
        apply_mapping(shown, defaults)
        print(doc.strip() + "\n" + USAGE + "\nThe settings of this command, with its defaults:\n" +
              help_text(shown, recipe))
        return None
    runtime_env_defaults()  # also for launch/*.py and the ds-rlhf-train-* scripts, which skip entrypoints.main
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    cfg = None
    owned = not _process_group_up()  # one this command sets up is its to tear down; an earlier one stays
    try:
        cfg = parse_config(argv, defaults, recipe)
        result = run(cfg)
    except USER_ERRORS as exc:  # bad settings, inputs or rewards: one line, no traceback
        if debug:
            raise
        sys.exit(f"error: {exc}")
    except OSError as exc:
        line = path_error_line(exc, cfg.run.output_dir if cfg is not None else None)
        if debug or line is None:
            raise
        sys.exit(f"error: {line}")
    except KeyboardInterrupt as exc:  # Ctrl-C outside the training loop's handler (which saves and exits 130)
        if debug:
            raise
        print(f"error: {str(exc) or 'interrupted (Ctrl-C)'}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    if owned:
        _shutdown_process_group()
    return result


def _process_group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _shutdown_process_group() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo/NCCL helper threads can abort it."""
    import torch.distributed as dist

    if _process_group_up():
        dist.barrier()
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and ds_comm.cdb is not None:
            # DeepSpeed's teardown: it also drops the groups it cached (its world-group clone), which a later run
            # in this process would otherwise find destroyed ("Group ... is not registered")
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
