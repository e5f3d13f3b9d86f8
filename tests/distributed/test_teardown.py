"""A run's teardown in one process (a notebook's runs, a test worker's tests): the command that set the process
group up tears it down through DeepSpeed (its cached groups go too, so the next run gets live ones), and a group that
was up before the command stays up for whoever owns it. In a subprocess: these tests set up and destroy the process
group, which other tests of a worker may hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ds_rlhf.testing.multiproc import clean_env

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups

    from ds_rlhf.cli import run_entry
    from ds_rlhf.distributed import ensure_distributed

    def clone_and_reduce(cfg):
        ensure_distributed()
        group = groups._clone_world_group()  # what a DeepSpeed engine caches (its world-group clone)
        x = torch.ones(1)
        dist.all_reduce(x, group=group)  # a destroyed group: "Group ... is not registered"
        return group

    first = run_entry("doc", {}, clone_and_reduce, ["--run.output_dir", "/tmp/unused"])
    assert not dist.is_initialized(), "the command set the group up: it tears it down"
    second = run_entry("doc", {}, clone_and_reduce, ["--run.output_dir", "/tmp/unused"])
    assert second is not first
    ensure_distributed()  # a group that is up before a command (the user's own) stays up after it
    run_entry("doc", {}, clone_and_reduce, ["--run.output_dir", "/tmp/unused"])
    assert dist.is_initialized()
    print("ok")
""")


def test_a_command_tears_down_the_group_it_set_up_and_only_that():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
