"""The tiny end-to-end demo (data -> SFT -> RM -> RL on one CPU): `python launch/pipeline.py --help`.

The command is `ds_rlhf.entrypoints.pipeline.main`, also installed as `ds-rlhf-pipeline` and `ds-rlhf pipeline`.
"""

from ds_rlhf.entrypoints.pipeline import main

if __name__ == "__main__":
    main()
