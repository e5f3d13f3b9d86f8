"""Checkpoints of small fake engines for the run-safety tests (test_run_safety.py, test_run_dir_safety.py):
`FakeEngine` has DeepSpeed's save/load interface over torch.save."""

from __future__ import annotations

from pathlib import Path

import torch

from ds_rlhf.config import parse_config
from ds_rlhf.run.checkpoint.manager import CheckpointManager


class FakeEngine:
    """DeepSpeed's engine checkpoint interface over torch.save: `<dir>/<tag>/{model,optim}_states.pt`."""

    def __init__(self, n: int = 16_384, seed: int = 0, blob_bytes: int = 0, fail_with: Exception | None = None):
        gen = torch.Generator().manual_seed(seed)
        self.module = torch.nn.Linear(n, 1, bias=False)
        with torch.no_grad():
            self.module.weight.copy_(torch.randn(1, n, generator=gen))
        self.moments = torch.randn(2, n, generator=gen)
        self.blob_bytes, self.fail_with = blob_bytes, fail_with

    def save_checkpoint(self, save_dir, tag, client_state):
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), "client": client_state}, path / "model_states.pt")
        if self.fail_with is not None:
            raise self.fail_with
        torch.save({"moments": self.moments, "blob": torch.zeros(self.blob_bytes // 4)}, path / "optim_states.pt")

    def load_checkpoint(self, load_dir, tag, load_optimizer_states=True, load_lr_scheduler_states=True):
        path = Path(load_dir) / tag
        model = torch.load(path / "model_states.pt", weights_only=True)
        self.module.load_state_dict(model["module"])
        self.moments = torch.load(path / "optim_states.pt", weights_only=True)["moments"]
        return str(path), model["client"]


def trainer_state(step):
    return {"loader": {"epoch": 0, "step": step, "seed": 0, "shuffle": True, "indices": "all"},
            "kl_ctl": {"value": 0.05}, "generator": torch.Generator().manual_seed(step).get_state()}


def checkpoint_manager(run_dir, logs=None, **kw):
    return CheckpointManager(run_dir, log=(logs.append if logs is not None else None), **kw)


def save_steps(run_dir, steps, **kw):
    mgr = checkpoint_manager(run_dir, **kw)
    for step in steps:
        mgr.save(step, {"actor": FakeEngine(seed=step)}, trainer_state(step))
    return mgr


def checkpoint_names(mgr):
    return [p.name for p in mgr.complete_checkpoints()]


def run_config(model, out, *extra):
    return parse_config(["--model.path", str(model), "--run.output_dir", str(out), "--run.tensorboard", "false",
                         "--run.progress", "false", *extra])
