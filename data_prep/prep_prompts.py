"""Prepare RL prompts (verl parquet, OpenRLHF JSONL, saved datasets) as a tokenized store.

Run `python data_prep/prep_prompts.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line (also installed as `ds-rlhf-prep-prompts`) and re-exports `prep_prompts` for Python callers.
"""

from __future__ import annotations

import sys

from ds_rlhf.data.prep import prep_prompts
from ds_rlhf.entrypoints.prep import main_prompts as main

__all__ = ["prep_prompts", "main"]

if __name__ == "__main__":
    sys.exit(main())
