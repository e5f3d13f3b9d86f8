"""Prepare reward-model preference pairs (HH-RLHF, UltraFeedback-binarized, prompt+responses).

Run `python data_prep/prep_preferences.py --help` for the options. The logic lives in `ds_rlhf.data.prep`; this file is
the command line (also installed as `ds-rlhf-prep-preferences`) and re-exports `prep_preferences` for Python callers.
"""

from __future__ import annotations

import sys

from ds_rlhf.data.prep import prep_preferences
from ds_rlhf.entrypoints.prep import main_preferences as main

__all__ = ["prep_preferences", "main"]

if __name__ == "__main__":
    sys.exit(main())
