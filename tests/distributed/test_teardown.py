"""A run's teardown (`cli._shutdown_process_group`) leaves nothing stale for the next run in the same process (a
notebook's second `train()`, a test worker's next test): DeepSpeed's cached groups go with the process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.utils import groups

from ds_rlhf.cli import _shutdown_process_group
from ds_rlhf.distributed import ensure_distributed


def test_a_second_run_in_one_process_gets_live_deepspeed_groups():
    ensure_distributed()
    first = groups._clone_world_group()  # what a DeepSpeed engine caches (its world-group clone)
    dist.all_reduce(torch.ones(1), group=first)
    _shutdown_process_group()
    try:
        ensure_distributed()
        second = groups._clone_world_group()
        assert second is not first
        x = torch.ones(1)
        dist.all_reduce(x, group=second)  # a destroyed group: "Group ... is not registered"
        assert x.item() == 1.0
    finally:
        _shutdown_process_group()
