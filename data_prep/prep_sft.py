"""Prepare SFT demonstrations (messages or prompt/response pairs) with assistant-only loss masks.

Run `python data_prep/prep_sft.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line (also installed as `ds-rlhf-prep-sft`) and re-exports `prep_sft` for Python callers.
"""

from __future__ import annotations

import sys

from ds_rlhf.data.prep import prep_sft
from ds_rlhf.entrypoints.prep import main_sft as main

__all__ = ["prep_sft", "main"]

if __name__ == "__main__":
    sys.exit(main())
