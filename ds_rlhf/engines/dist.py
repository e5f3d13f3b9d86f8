"""The one place that starts torch.distributed (through DeepSpeed) for every entry point, test and benchmark.

On the CPU accelerator DeepSpeed also builds a shared-memory all-reduce whose buffer it never removes:
`/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, 64 MiB per rank per run. /dev/shm is RAM, so a
test suite or a day of CPU runs fills memory until something is OOM-killed. Once every rank has mapped every
peer's buffer (DeepSpeed does that inside its init, before the barrier below returns) the names are no longer
needed: we unlink this rank's, and the kernel frees the memory when the last mapping goes, even after `kill -9`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
from datetime import timedelta

# torch.distributed / launcher variables: a child process that must form its own process group (a test's
# subprocess, the disaggregated vLLM server) starts without them, or it would join (or collide with) ours.
DIST_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "CROSS_RANK", "CROSS_SIZE")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def clean_dist_env(**extra: str) -> dict:
    """This process's environment without its distributed variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env.update(extra)
    return env


def ensure_distributed(timeout: timedelta | None = None) -> None:
    """Initialise torch.distributed if nobody has: NCCL on GPU, gloo on CPU (the CPU accelerator's default, oneCCL,
    is not installed). Without a launcher's env (plain `python`) this process is a world of one on a free port."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    on_cpu = get_accelerator().device_name() == "cpu"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else get_accelerator().communication_backend_name(),
                               **kwargs)
    if on_cpu:
        dist.barrier()  # every rank has mapped every peer's buffer
        unlink_shm_buffer(dist.get_rank())


def unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's DeepSpeed CPU all-reduce buffer name (see the module docstring)."""
    port = os.environ.get("MASTER_PORT", "*")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        with contextlib.suppress(FileNotFoundError):  # a second init in this process: already gone
            os.unlink(path)
