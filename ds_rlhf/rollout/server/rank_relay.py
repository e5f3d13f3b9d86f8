"""How a data-parallel trainer's ranks share one rollout server: every rank's request goes to trainer rank 0, which
talks to the server, and each rank gets its own part of the answer back (`client.RemoteVLLMEngine`'s collective
calls). `d` is torch.distributed with a process group of several ranks, or None for a single rank."""

from __future__ import annotations

from ds_rlhf.rollout.base import RolloutError


def gather_to_owner(d, owner: bool, item) -> list | None:
    """Every rank's `item`, as a list on rank 0 (None elsewhere)."""
    if d is None:
        return [item]
    items = [None] * d.get_world_size() if owner else None
    d.gather_object(item, items, dst=0)
    return items


def scatter_from_owner(d, owner: bool, run) -> object:
    """Rank 0 calls `run()` for a list with one result per rank and hands each rank its own; an error there is raised
    on every rank."""
    results = None
    if owner:
        try:
            results = [("ok", r) for r in run()]
        except Exception as e:  # noqa: BLE001  re-raised on every rank below
            results = [("error", f"{type(e).__name__}: {e}")] * (d.get_world_size() if d else 1)
    if d is None:
        out = results
    else:
        out = [None]
        d.scatter_object_list(out, results, src=0)
    status, payload = out[0]
    if status == "error":
        raise RolloutError(f"rollout (on trainer rank 0) failed: {payload}")
    return payload
