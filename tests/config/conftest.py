"""`train_command(name, argv)`: a training command's main (`ds_rlhf.entrypoints.train.main_*`) with its trainer
replaced by one that keeps the parsed config, so a test sees what the command line gives the trainer, or the one
`error: ...` line it exits with (SystemExit), without building any model."""

from __future__ import annotations

import pytest

from ds_rlhf.entrypoints import train


@pytest.fixture
def train_command(monkeypatch):
    def run(name: str, argv: list[str]):
        kind = name.removeprefix("train-")
        seen = []
        monkeypatch.setattr(train, f"run_{kind}", seen.append)
        getattr(train, f"main_{kind}")(list(argv))
        return seen[0] if seen else None

    return run

