"""Prepare GSM8K (official question/answer JSONL) as RL prompts with ground truth, or as SFT.

Run `python data_prep/prep_gsm8k.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line (also installed as `ds-rlhf-prep-gsm8k`) and re-exports `prep_gsm8k` for Python callers.
"""

from __future__ import annotations

import sys

from ds_rlhf.data.prep import prep_gsm8k
from ds_rlhf.entrypoints.prep import main_gsm8k as main

__all__ = ["prep_gsm8k", "main"]

if __name__ == "__main__":
    sys.exit(main())
