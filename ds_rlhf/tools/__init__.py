"""Operator tools: `ds-rlhf doctor` (is this machine ready?), `ds-rlhf memory` (will this config fit?),
`ds-rlhf report` (what did this run do?) and `health` (is the running step slower than it should be?).

None of them loads model weights or starts a process group; each is a console script and a `python -m` module.
"""
