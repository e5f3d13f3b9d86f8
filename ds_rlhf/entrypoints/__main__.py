"""`python -m ds_rlhf.entrypoints <command> ...`: the `ds-rlhf` umbrella without the console script."""

import sys

from ds_rlhf.entrypoints.main import main

sys.exit(main())
