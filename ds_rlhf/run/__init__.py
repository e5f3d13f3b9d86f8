"""The machinery under a recipe: run context, run directory, checkpoints, signals, preflight checks, placement, the
run monitor and the environment checks it shares with `ds-rlhf doctor`."""
