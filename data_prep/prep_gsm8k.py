"""Prepare GSM8K (official question/answer JSONL) as RL prompts with ground truth, or as SFT.

Run `python data_prep/prep_gsm8k.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line and re-exports `prep_gsm8k` for Python callers.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_rlhf.data.prep import prep_gsm8k  # noqa: E402

__all__ = ["prep_gsm8k", "main"]


def main(argv: list[str] | None = None) -> int:
    from ds_rlhf.data.prep import cli

    return cli("prep_gsm8k", argv)


if __name__ == "__main__":
    sys.exit(main())
