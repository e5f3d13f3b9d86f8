"""Where the pieces run: training ranks and vLLM engines, checked before any model is loaded.

Supported layouts (one node or many; every training rank holds the actor, critic, reference and reward model):
- colocated: each training rank's GPU also runs vLLM (sleep mode frees it while DeepSpeed trains). With
  `rollout.tensor_parallel_size` k > 1, groups of k ranks share one vLLM engine (k must divide the world size).
- disaggregated: vLLM runs in its own process on `rollout.devices` of the first node, which must not hold a
  training rank; one engine with tensor parallelism over exactly those GPUs (so `len(devices) == tp`).
- sidecar (one rank, one GPU): vLLM in its own process on the training GPU, the memory split between the two by
  `rollout.gpu_memory_utilization` (the trainer is capped at the rest), so generation can overlap training
  (`rollout.async_generation`). On CPU it is a second process on the same cores.
Impossible layouts fail here with a message that says what to change, not later as an out-of-memory or a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ds_rlhf.errors import ConfigError


def parse_devices(spec: str) -> list[int]:
    """"4,5,6,7", "4-7" or "0,2-3" -> sorted GPU ids; duplicates and junk are errors."""
    if not spec.strip():
        return []
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                ids.extend(range(lo, hi + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise ConfigError(f"rollout.devices: cannot read {part!r} in {spec!r} (use e.g. \"4,5\" or \"4-7\")") \
                from None
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ConfigError(f"rollout.devices {spec!r} lists a GPU twice or a negative id")
    return sorted(ids)


@dataclass(frozen=True)
class Placement:
    mode: str  # colocated | disaggregated
    train_devices: tuple[int, ...]  # physical GPU ids of this node's training ranks (empty on CPU)
    rollout_devices: tuple[int, ...]  # physical GPU ids of the disaggregated vLLM server (empty otherwise)
    tensor_parallel_size: int
    weight_transport: str = "own"  # rollout.weight_transport (vllm: a sidecar or disaggregated server on GPUs)

    def engine_kwargs(self) -> dict:
        """Keyword arguments for `make_rollout_engine`."""
        kw = {"tensor_parallel_size": self.tensor_parallel_size}
        if self.mode in ("disaggregated", "sidecar") and self.rollout_devices:
            kw["devices"] = list(self.rollout_devices)
        if self.mode == "sidecar" and self.rollout_devices:
            kw["weight_backend"] = "ipc"  # same GPU: CUDA IPC (NCCL refuses two ranks on one device)
        if self.weight_transport != "own":
            kw["weight_transport"] = self.weight_transport
        return kw


def _physical(local_ids: range) -> tuple[int, ...]:
    """Physical GPU ids of local device indices, honouring a launcher's CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return tuple(local_ids)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in ids):  # UUIDs: we cannot compare them with rollout.devices
        raise ConfigError("CUDA_VISIBLE_DEVICES uses GPU UUIDs; give numeric ids so the placement can be checked")
    return tuple(int(ids[i]) for i in local_ids)


def resolve_placement(cfg, *, world_size: int, local_world_size: int, gpus_on_node: int) -> Placement:
    """Validate the rollout placement against the training ranks; `gpus_on_node` = 0 on a CPU machine.

    The disaggregated server is started by trainer rank 0, so its devices are checked against rank 0's node."""
    r = cfg.rollout
    tp = r.tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {tp}")
    train = _physical(range(local_world_size)) if gpus_on_node else ()
    if gpus_on_node and any(d >= gpus_on_node for d in train):
        raise ConfigError(f"{local_world_size} training ranks on this node need GPUs {list(train)}, but the node has "
                          f"{gpus_on_node}")
    devices = parse_devices(r.devices)
    if r.placement == "colocated":
        if devices:
            raise ConfigError("rollout.devices is for rollout.placement=disaggregated; colocated vLLM runs on the "
                              "training ranks' own GPUs")
        if world_size % tp:
            raise ConfigError(f"colocated vLLM with tensor_parallel_size={tp} groups ranks in {tp}s, but the world "
                              f"size is {world_size}: choose a tp that divides it")
        return Placement("colocated", train, (), tp)
    if r.placement == "sidecar":
        if devices:
            raise ConfigError("rollout.placement=sidecar runs vLLM in its own process on the training GPU; "
                              "rollout.devices is for disaggregated placement")
        if world_size != 1 or tp != 1:
            raise ConfigError("rollout.placement=sidecar is for one training rank and one GPU (its memory split "
                              "between the trainer and vLLM by rollout.gpu_memory_utilization); with several GPUs "
                              "use disaggregated placement")
        if r.weight_transport == "vllm" and not gpus_on_node:
            raise ConfigError("rollout.weight_transport=vllm moves weights over CUDA IPC, but this machine has no GPU "
                              "(the sidecar then syncs over gloo): use --rollout.weight_transport own")
        return Placement("sidecar", train, train[:1], 1, r.weight_transport)
    if r.placement != "disaggregated":
        raise ConfigError(f"rollout.placement={r.placement!r}: choose colocated, sidecar or disaggregated")
    if not gpus_on_node:
        if devices:
            raise ConfigError("rollout.devices lists GPUs, but this machine has none (on CPU the disaggregated "
                              "engine runs as a second process on the same cores)")
        if r.weight_transport == "vllm":
            raise ConfigError("rollout.weight_transport=vllm moves weights over NCCL, but this machine has no GPU "
                              "(the disaggregated engine then syncs over gloo): use --rollout.weight_transport own")
        return Placement("disaggregated", (), (), tp)
    if not devices:
        free = [d for d in range(gpus_on_node) if d not in train]
        raise ConfigError(f"rollout.placement=disaggregated needs rollout.devices (GPUs without a training rank; "
                          f"free on this node: {free or 'none'})")
    clash = sorted(set(devices) & set(train))
    if clash:
        raise ConfigError(f"rollout.devices {devices} overlap the training ranks' GPUs {list(train)} at {clash}; "
                          "use colocated placement to share GPUs, or launch training on fewer GPUs "
                          "(deepspeed --include localhost:0,1,...)")
    missing = [d for d in devices if d >= gpus_on_node]
    if missing:
        raise ConfigError(f"rollout.devices {missing} do not exist: this node has GPUs 0-{gpus_on_node - 1}")
    if len(devices) != tp:
        raise ConfigError(f"the disaggregated vLLM engine runs tensor-parallel over all of rollout.devices: "
                          f"{len(devices)} devices need rollout.tensor_parallel_size={len(devices)} (got {tp})")
    return Placement("disaggregated", train, tuple(devices), tp, r.weight_transport)


def physical_gpu_count() -> int:
    """GPUs on this node, not just those visible to this process (NVML when it is there)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # no NVML: the highest visible physical id is the best we know
        return 1 + max(_physical(range(torch.cuda.device_count())))
