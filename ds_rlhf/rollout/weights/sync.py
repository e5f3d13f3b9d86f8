"""One call that moves the trainer's current weights into the rollout engine and proves they arrived.

`WeightSync(engine, rollout, bucket_bytes=..., canary=...).sync()` on every trainer rank:
1. if the rollout engine sleeps, wake its weights only (the KV cache stays released while we gather);
2. stream ZeRO-gathered buckets from the bridge into the engine (in-process load for colocated engines, one
   broadcast per bucket after one control message for disaggregated ones); ranks without an engine still drain the
   bucket iterator under ZeRO-3 because the gathers are collective;
3. the engine's transport drops its prefix cache (its KV was computed with the old weights);
4. wake the KV cache last;
5. run the canary (all ranks), which raises SyncCanaryError when the engine does not match the trainer.
Returns (and logs) seconds, bytes and GB/s of step 2, the bucket count, the largest gathered bucket and the canary
difference.

`sync(wait=False)` (async generation with an engine in its own process): steps 2 and 5 do not wait for the engine.
The buckets are handed over and the canary's probe is sent, and the trainer goes on: the engine loads, scores the
probe and then runs the generation submitted after the sync, in that order. `confirm()` reads its acknowledgement
and finishes the canary (SyncCanaryError as above); the caller calls it before training on anything generated after
the sync. `seconds` is then the trainer's time to hand the weights over; the canary's figures come with `confirm()`.
Engines that cannot defer (in-process ones, several ranks) finish both steps in `sync` as before.

`mode="adapter"` (a LoRA actor on a frozen base, an engine started with LoRA: `rollout.lora_sync=adapter`) replaces
step 2 by an adapter-only transfer (`adapter_sync.py`): gather the LoRA A/B tensors, write them as a peft adapter
directory, and have the engine serve it as the next adapter version; a quantized base is sent once, at the first
sync. `bytes` is then what actually moved: the adapters (plus that one base), not the merged model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ds_rlhf.engines.models import unwrap
from ds_rlhf.rollout.base import Pending, RolloutEngine, RolloutError
from ds_rlhf.rollout.weights import adapter_sync
from ds_rlhf.rollout.weights.canary import SyncCanary, rollout_weight_dtype
from ds_rlhf.rollout.weights.gather import DEFAULT_BUCKET_BYTES, WeightBuckets, iter_weight_buckets

log = logging.getLogger(__name__)


MODES = ("merged", "adapter")


class WeightSync:
    """`mode`: "merged" (full weights, LoRA merged in) or "adapter" (LoRA adapters only; `adapter_dir`: where the
    adapter versions are written, a private temporary directory when None; `send_base`: send the base once at the
    first sync, None = only when it is quantized, i.e. differs from the checkpoint the engine loaded)."""

    def __init__(self, engine, rollout: RolloutEngine | None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 canary: SyncCanary | None = None, name_map: Callable[[str], str | None] | None = None,
                 mode: str = "merged", adapter_dir: str | None = None, send_base: bool | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown weight sync mode {mode!r}: expected one of {MODES}")
        if rollout is not None and rollout.weights is None:
            raise RolloutError(f"{type(rollout).__name__} has no weight transport (RolloutEngine.weights)")
        if mode == "adapter" and rollout is not None and not rollout.weights.lora_enabled:
            raise RolloutError(f"WeightSync(mode='adapter') needs a rollout engine started with LoRA, but "
                               f"{type(rollout).__name__} has none (make_rollout_engine(..., lora={{'rank': r}}))")
        self.engine = engine
        self.rollout = rollout
        self.bucket_bytes = bucket_bytes
        self.canary = canary
        self.name_map = name_map
        self.mode = mode
        self.send_base = send_base
        self.adapter_version = 0
        self._adapter_dir = adapter_dir
        self._dirs: adapter_sync.AdapterDir | None = None
        self.history: list[dict] = []
        self._unconfirmed: tuple | None = None  # (the engine's acknowledgement, the canary check, the info)

    @property
    def pending(self) -> bool:
        """True from a `sync(wait=False)` that handed the weights over without waiting until its `confirm()`."""
        return self._unconfirmed is not None

    def sync(self, *, check: bool = True, wait: bool = True) -> dict:
        """Move the weights (see the module docstring); `wait=False` leaves the engine's acknowledgement and the
        canary's verdict to `confirm()` where the engine can defer them (merged mode, an awake engine)."""
        self.confirm()  # an earlier sync made without waiting is confirmed first
        rollout = self.rollout
        if (not wait and self.mode == "merged" and rollout is not None and not rollout.sleeping
                and rollout.defers_replies):
            return self._hand_over(check)
        t_start = time.perf_counter()
        was_asleep = rollout is not None and rollout.sleeping
        if was_asleep:
            rollout.wake(("weights",))
        t0 = time.perf_counter()
        info = self._send_adapter() if self.mode == "adapter" else self._send_merged()
        seconds = self._settle(info, t0)
        if was_asleep:
            rollout.wake(("kv_cache",))
        if self.canary is not None and check:
            try:
                self.canary.check(self.engine, rollout)
            finally:
                c = self.canary.history[-1] if self.canary.history else {}
                info.update(canary_max_abs_diff=c.get("max_abs_diff"), canary_seconds=c.get("seconds"))
        info["total_seconds"] = time.perf_counter() - t_start
        self.history.append(info)
        log.info("weight sync (%s): %.3f GB in %.3f s (%.2f GB/s, %d buckets, canary diff %s)", self.mode,
                 info["bytes"] / 1e9, seconds, info["gbps"], info["buckets"], info["canary_max_abs_diff"])
        return info

    def _hand_over(self, check: bool) -> dict:
        """`sync(wait=False)` where the engine defers: the trainer's side of the canary first (on a GPU the
        engines' loads do not share yet; the weights are the same), then the buckets and the probe, unread."""
        t_start = time.perf_counter()
        checked = self.canary is not None and check
        probe = self.canary.probe(self.engine, rollout_weight_dtype(self.rollout)) if checked else None
        t0 = time.perf_counter()
        info, acknowledged = self._send_merged(later=True)
        seconds = self._settle(info, t0)
        canary = self.canary.start(self.engine, self.rollout, probe=probe) if probe is not None else None
        info.update(deferred=1, total_seconds=time.perf_counter() - t_start)
        self._unconfirmed = (acknowledged, canary, info)
        self.history.append(info)
        log.info("weight sync (%s): %.3f GB handed over in %.3f s; load and canary confirmed later", self.mode,
                 info["bytes"] / 1e9, seconds)
        return info

    def _settle(self, info: dict, t0: float) -> float:
        """After the buckets went out (the engine's transport dropped its prefix cache): let our device copies
        finish (so they are timed); records the seconds since `t0` and the rate in `info` (the canary's figures not
        yet) and returns the seconds."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # device copies are asynchronous: time them to completion
        seconds = time.perf_counter() - t0
        info.update(mode=self.mode, seconds=seconds, canary_max_abs_diff=None,
                    gbps=info["bytes"] / seconds / 1e9 if seconds > 0 else 0.0)
        return seconds

    def confirm(self) -> dict | None:
        """Finish a sync made with `wait=False`: wait for the engine's acknowledgement (its error, if any, is
        raised), then the canary's comparison (SyncCanaryError). Returns the canary's figures (`canary_max_abs_diff`,
        `canary_seconds`: the trainer's own time in it) and `confirm_seconds` (this call's time), also added to that
        sync's history entry; None when no sync is unconfirmed. Every rank calls it at the same point."""
        if self._unconfirmed is None:
            return None
        acknowledged, canary, info = self._unconfirmed
        self._unconfirmed = None
        t0 = time.perf_counter()
        out = {"canary_max_abs_diff": None, **_load_figures(acknowledged.result())}
        if canary is not None:
            try:
                canary.finish()
            finally:
                c = self.canary.history[-1] if self.canary.history else {}
                out.update(canary_max_abs_diff=c.get("max_abs_diff"), canary_seconds=c.get("seconds"))
        out["confirm_seconds"] = time.perf_counter() - t0
        info.update(out)
        return out

    def _dtype(self):
        return self.rollout.weights.dtype if self.rollout is not None else None

    def _stream(self, buckets: WeightBuckets, later: bool = False) -> Pending:
        """Buckets into the engine, or (no engine on this rank) drained for ZeRO-3's collective gathers. `later`:
        the engine may acknowledge after this returns (the `Pending` reads it); else it is read here."""
        if self.rollout is not None:
            acknowledged = self.rollout.weights.send(buckets, buckets.plan, wait=not later)
            return acknowledged if later else Pending.done(acknowledged.result())
        if buckets.zero3:
            buckets.drain()
        return Pending.done()

    def _send_merged(self, later: bool = False):
        """The merged weights into the engine: their info, and with `later` also the engine's `Pending`
        acknowledgement."""
        buckets = iter_weight_buckets(self.engine, self.bucket_bytes, name_map=self.name_map, dtype=self._dtype())
        acknowledged = self._stream(buckets, later)
        info = {"bytes": buckets.bytes, "buckets": len(buckets), "max_gathered_bytes": buckets.max_gathered_bytes,
                "zero3": buckets.zero3}
        return (info, acknowledged) if later else {**info, **_load_figures(acknowledged.result())}

    def _send_adapter(self) -> dict:
        """The base once where needed, then the adapters as the next version of the engine's LoRA adapter."""
        module = unwrap(self.engine)
        base_bytes, gathered = 0, 0
        if self.adapter_version == 0:
            adapter_sync.check_frozen_base(module)
            if self.send_base or (self.send_base is None and adapter_sync.base_is_quantized(module)):
                base = iter_weight_buckets(self.engine, self.bucket_bytes, name_map=self.name_map,
                                           dtype=self._dtype(), merge_lora=False)
                self._stream(base)
                base_bytes, gathered = base.bytes, base.max_gathered_bytes
        buckets = WeightBuckets(self.engine, self.bucket_bytes, dtype=self._dtype(),
                                entries=adapter_sync.adapter_entries(module))
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for bucket in buckets for name, t in bucket}
        self.adapter_version += 1
        info: dict = {"adapter_id": None}
        if self.rollout is not None:
            if self._dirs is None:
                self._dirs = adapter_sync.AdapterDir(self._adapter_dir, per_rank=True)
            path = self._dirs.write(self.adapter_version, tensors, adapter_sync.lora_config(module))
            info["adapter_id"] = self.rollout.weights.load_adapter(str(path))
            self._dirs.prune(keep=path)
        return {**info, "bytes": base_bytes + buckets.bytes, "adapter_bytes": buckets.bytes, "base_bytes": base_bytes,
                "adapter_version": self.adapter_version, "buckets": len(buckets), "zero3": buckets.zero3,
                "max_gathered_bytes": max(gathered, buckets.max_gathered_bytes)}

    def close(self) -> None:
        """Remove the adapter directories this sync wrote into its own temporary directory (idempotent)."""
        if self._dirs is not None:
            self._dirs.close()
            self._dirs = None


def _load_figures(acknowledgement) -> dict:
    """`engine_load_seconds` from an engine's acknowledgement of a weight update where it reports one (a server:
    its slowest server's own time loading the update), else nothing."""
    if isinstance(acknowledgement, dict) and acknowledgement.get("load_seconds") is not None:
        return {"engine_load_seconds": float(acknowledgement["load_seconds"])}
    return {}
