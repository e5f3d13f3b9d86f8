"""Prepare SFT demonstrations (messages or prompt/response pairs) with assistant-only loss masks.

Run `python data_prep/prep_sft.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line and re-exports `prep_sft` for Python callers.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_rlhf.data.prep import prep_sft  # noqa: E402

__all__ = ["prep_sft", "main"]


def main(argv: list[str] | None = None) -> int:
    from ds_rlhf.data.prep import cli

    return cli("prep_sft", argv)


if __name__ == "__main__":
    sys.exit(main())
