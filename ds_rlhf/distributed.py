"""Every torch.distributed helper in one place: starting the process group for every entry point, test and
benchmark, the launcher environment, and the small collectives the trainers share.

Launchers: the process group is set up the same way for the three ways users launch.

- `deepspeed` sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_SIZE/MASTER_* and appends `--local_rank=N` (the config schema
  accepts and ignores that key).
- `accelerate launch` sets the same env vars but LOCAL_WORLD_SIZE instead of LOCAL_SIZE, and describes its
  DeepSpeed plugin through ACCELERATE_DEEPSPEED_* variables; those fill in settings the user left at defaults.
- plain `python` sets nothing: we run as a single process on a free local port.

Rendezvous: torch's TCPStore (unauthenticated: whoever reaches it can join or disrupt the group) listens on every
interface when torch creates it. A single-node run (no launcher, or every rank on this host: WORLD_SIZE equals
LOCAL_WORLD_SIZE / LOCAL_SIZE) builds the store itself on a socket bound to 127.0.0.1 and points gloo's own
listeners at the loopback interface (GLOO_SOCKET_IFNAME=lo unless set; `unpinned` lifts it for a group with another
host); a multi-node run keeps the launcher's MASTER_ADDR and torch's store, and so does a torchrun worker (its agent
owns the store). NCCL's bootstrap socket is NCCL's own (NCCL_SOCKET_IFNAME), left as the user set it.

CPU shared memory: on the CPU accelerator DeepSpeed's torch backend JIT-builds (C++, ~40 s on two cores) a
shared-memory all-reduce, `deepspeed_shm_comm`, used only by `deepspeed.comm.inference_all_reduce` (DeepSpeed
inference tensor parallelism, which ds_rlhf never calls; every collective here is torch.distributed over gloo).
`ensure_distributed` therefore makes DeepSpeed skip that build on CPU, so no shm op is loaded and no buffer is
created. A built op leaves a buffer it never removes:
`/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, 64 MiB per rank per run (/dev/shm is RAM, so a
test suite or a day of CPU runs fills memory until something is OOM-killed). The unlink after the barrier below
is a guard for a run where the op was built: once every rank has mapped every peer's buffer the names are not
needed, and the kernel frees the memory when the last mapping goes, even after `kill -9`.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from ds_rlhf.config import Config
from ds_rlhf.cpu_fused_adam import install as install_cpu_fused_adam

# torch.distributed / launcher variables: a child process that must form its own process group (a test's
# subprocess, the disaggregated vLLM server) starts without them, or it would join (or collide with) ours.
DIST_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "CROSS_RANK", "CROSS_SIZE")


# environment variables this process set to keep its listeners on loopback (`init_loopback_group`), and their values
_PINNED: dict[str, str] = {}


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

    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:
        # DeepSpeed's TorchBackend builds its shared-memory all-reduce op in __init__ through this module-level
        # function; the op only serves inference_all_reduce (DeepSpeed inference TP), which ds_rlhf never calls.
        # Returning None (as DeepSpeed does where the op is incompatible) skips a ~40 s C++ JIT build per fresh
        # extensions dir and its /dev/shm buffer; training collectives are plain torch.distributed (gloo) either way.
        # (import_module: the attribute `deepspeed.comm.torch` is the torch package, which comm re-exports.)
        # Patched before the early return: deepspeed.initialize sets up DeepSpeed's comm even when torch's is up.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_shm_op
        # FusedAdam's CPU op is DeepSpeed's CPU Adam step, JIT-built (~90 s); served in torch ops instead
        # (cpu_fused_adam.py: the same update, FusedAdam itself unchanged)

        install_cpu_fused_adam()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = "gloo" if on_cpu else get_accelerator().communication_backend_name()
    if single_node():  # our own store on 127.0.0.1; DeepSpeed then finds torch.distributed initialised
        init_loopback_group(backend, timeout or timedelta(minutes=30))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend=backend, **kwargs)
    if on_cpu:
        dist.barrier()  # every rank has mapped every peer's buffer (none now: the shm op is not built)
        unlink_shm_buffer(dist.get_rank())


def single_node(environ=os.environ) -> bool:
    """Whether every rank of this run is on this host: no launcher (a world of one), or a launcher whose local world
    is the whole world. A torchrun worker (its agent already serves the store) counts as not ours to bind."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False
    world = environ.get("WORLD_SIZE")
    local = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE")
    if world is None:
        return True
    return world == "1" or (local is not None and local == world)


def loopback_store(port: int, world_size: int, is_master: bool, timeout: timedelta, host: str = "127.0.0.1"):
    """A TCPStore whose server (on the master) listens on `host` only, not on every interface."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        if world_size != 1:  # the other ranks look for the store at this port
            sock.close()
            raise
        sock.bind((host, 0))  # a world of one (a second run in this process): nobody else needs to find it
    sock.listen(max(128, world_size))
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout, master_listen_fd=sock.detach())


def init_loopback_group(backend: str, timeout: timedelta) -> None:
    """torch.distributed's default group for a single-node run, its rendezvous on 127.0.0.1 (see the module doc)."""
    import torch.distributed as dist

    if "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo reads it for every group it creates, subgroups included
        os.environ["GLOO_SOCKET_IFNAME"] = _PINNED["GLOO_SOCKET_IFNAME"] = "lo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = loopback_store(int(os.environ["MASTER_PORT"]), world, rank == 0, timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


@contextlib.contextmanager
def unpinned():
    """Within the block, the variables `init_loopback_group` set to keep gloo on the loopback interface are unset:
    for a group with a member on another host (the weight-sync group of a remote rollout server)."""
    saved = {k: os.environ.pop(k) for k, v in _PINNED.items() if os.environ.get(k) == v}
    try:
        yield
    finally:
        os.environ.update(saved)


def _no_shm_op():
    """Stand-in for `deepspeed.comm.torch.build_shm_op` on CPU: no shared-memory op (see `ensure_distributed`)."""
    return None


def unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's DeepSpeed CPU all-reduce buffer name (see the module docstring)."""
    port = os.environ.get("MASTER_PORT", "*")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        with contextlib.suppress(FileNotFoundError):  # a second init in this process: already gone
            os.unlink(path)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def apply_accelerate_env(cfg: Config) -> None:
    """Take DeepSpeed settings from an `accelerate launch` DeepSpeed plugin where the user gave none."""
    default = Config()
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file and config_file != "none" and cfg.ds_config == default.ds_config:
        cfg.ds_config = config_file
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage and cfg.zero_stage == -1:
        cfg.zero_stage = int(stage)
    offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")
    if offload == "cpu" and not cfg.offload:
        cfg.offload = True
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if precision in ("bf16", "fp16") and cfg.model.dtype == "auto":
        cfg.model.dtype = precision


def init_distributed(cfg: Config) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPU, gloo on CPU) and pick this rank's device."""
    from datetime import timedelta

    import torch.distributed as dist

    if cfg.local_rank >= 0:  # the `deepspeed` launcher's --local_rank, when its env var is missing
        os.environ.setdefault("LOCAL_RANK", str(cfg.local_rank))
    apply_accelerate_env(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        device = torch.device("cpu")
    # A finite timeout turns a lost rank or node into an error on every other rank instead of a silent hang.
    ensure_distributed(timeout=timedelta(minutes=cfg.run.dist_timeout_minutes))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_mean(values: dict[str, float], device) -> dict[str, float]:
    """Average scalar metrics over ranks (one collective for the whole dict)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1) or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def agree_max(value: int, device) -> int:
    """The largest `value` over ranks. ZeRO reduces gradients (and ZeRO-3 gathers weights) inside every
    forward/backward, so all ranks must run the same number of micro-batches or the collectives deadlock."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def multi_rank() -> bool:
    """True when a process group of more than one rank is running (collectives are needed)."""
    return world()[1] > 1
