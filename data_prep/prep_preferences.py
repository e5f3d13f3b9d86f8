"""Prepare reward-model preference pairs (HH-RLHF, UltraFeedback-binarized, prompt+responses).

Run `python data_prep/prep_preferences.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line and re-exports `prep_preferences` for Python callers.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_rlhf.data.prep import prep_preferences  # noqa: E402

__all__ = ["prep_preferences", "main"]


def main(argv: list[str] | None = None) -> int:
    from ds_rlhf.data.prep import cli

    return cli("prep_preferences", argv)


if __name__ == "__main__":
    sys.exit(main())
