"""One call that moves the trainer's current weights into the rollout engine and proves they arrived.

`WeightSync(engine, rollout, bucket_bytes=..., canary=...).sync()` on every trainer rank:
1. if the rollout engine sleeps, wake its weights only (the KV cache stays released while we gather);
2. stream ZeRO-gathered buckets from the bridge into the engine (in-process load for colocated engines, one
   broadcast per bucket after one control message for disaggregated ones); ranks without an engine still drain the
   bucket iterator under ZeRO-3 because the gathers are collective;
3. drop the engine's prefix cache (its KV was computed with the old weights);
4. wake the KV cache last;
5. run the canary (all ranks), which raises SyncCanaryError when the engine does not match the trainer.
Returns (and logs) seconds, bytes and GB/s of step 2, the bucket count, the largest gathered bucket and the canary
difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ds_rlhf.rollout.base import RolloutEngine
from ds_rlhf.rollout.canary import SyncCanary
from ds_rlhf.rollout.weight_gather import DEFAULT_BUCKET_BYTES, iter_weight_buckets

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, engine, rollout: RolloutEngine | None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 canary: SyncCanary | None = None, name_map: Callable[[str], str | None] | None = None) -> None:
        self.engine = engine
        self.rollout = rollout
        self.bucket_bytes = bucket_bytes
        self.canary = canary
        self.name_map = name_map
        self.history: list[dict] = []

    def sync(self, *, check: bool = True) -> dict:
        rollout = self.rollout
        t_start = time.perf_counter()
        was_asleep = rollout is not None and rollout.sleeping
        if was_asleep:
            rollout.wake(("weights",))
        t0 = time.perf_counter()
        buckets = iter_weight_buckets(self.engine, self.bucket_bytes, name_map=self.name_map,
                                      dtype=rollout.weight_dtype if rollout is not None else None)
        if rollout is not None:
            rollout.update_weight_buckets(buckets, plan=buckets.plan)
            rollout.reset_cache()
        elif buckets.zero3:
            buckets.drain()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # device copies are asynchronous: time them to completion
        seconds = time.perf_counter() - t0
        if was_asleep:
            rollout.wake(("kv_cache",))
        info = {
            "seconds": seconds, "bytes": buckets.bytes, "gbps": buckets.bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "buckets": len(buckets), "max_gathered_bytes": buckets.max_gathered_bytes, "zero3": buckets.zero3,
            "canary_max_abs_diff": None,
        }
        if self.canary is not None and check:
            try:
                self.canary.check(self.engine, rollout)
            finally:
                c = self.canary.history[-1] if self.canary.history else {}
                info.update(canary_max_abs_diff=c.get("max_abs_diff"), canary_seconds=c.get("seconds"))
        info["total_seconds"] = time.perf_counter() - t_start
        self.history.append(info)
        log.info("weight sync: %.3f GB in %.3f s (%.2f GB/s, %d buckets, canary diff %s)", info["bytes"] / 1e9,
                 seconds, info["gbps"], info["buckets"], info["canary_max_abs_diff"])
        return info
