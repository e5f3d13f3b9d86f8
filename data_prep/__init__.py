"""Command-line data preparation: dataset files -> pre-tokenized Arrow stores (see `ds_rlhf.data.prep`).

Each script is also importable, e.g. ``from data_prep.prep_prompts import prep_prompts``.
"""
