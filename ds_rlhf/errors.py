"""The error classes a user meets: a mistake in an input that changing that input fixes. They import nothing of
ds_rlhf, so every layer raises them; `cli.py` prints them as one `error: ...` line."""

from __future__ import annotations


class UserInputError(ValueError):
    """A mistake in what the user gave (a setting, a file, a directory, a model) that changing that input fixes.
    Raise it where the wrong input is known, naming the input and what to change: the command line (`cli.py`) prints
    its message as one `error: ...` line without a traceback (`--debug` or DS_RLHF_DEBUG=1 shows the traceback)."""


class ConfigError(UserInputError):
    """A config key or value the schema does not accept."""
