"""The command-line entry points: the installed console scripts and the `ds-rlhf` umbrella command.

- `train`: `main_sft`, `main_rm`, `main_ppo` (`ds-rlhf-train-sft`, ... and `launch/train_*.py`);
- `prep`: `main_prompts`, `main_gsm8k`, `main_sft`, `main_preferences` (`ds-rlhf-prep-*` and `data_prep/*.py`);
- `pipeline`: `main` (`ds-rlhf-pipeline` and `launch/pipeline.py`);
- `main`: the umbrella, `ds-rlhf <command> ...`, dispatching through its `SUBCOMMANDS` table.

Every `main*` takes `argv` (default: `sys.argv[1:]`) and returns an exit code (0 or None on success), so it serves
a console script, a `launch/` wrapper and a test alike. Nothing heavy is imported before the arguments are parsed:
`--help` never loads torch models.
"""
