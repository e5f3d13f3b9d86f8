"""RewardSpec / RewardSet: one or several weighted reward functions, run in-process or in a worker pool."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ds_rlhf.rewards.builtin import BUILTIN_REWARDS
from ds_rlhf.rewards.calling import BATCHED_STYLES, Outcome, detect_style, invoke, make_call
from ds_rlhf.rewards.loading import STYLES, absolute_spec, check_spec, load_reward_fn, registered, split_style
from ds_rlhf.rewards.pool import START_TIMEOUT_S, RewardPool
from ds_rlhf.rewards.remote import DEFAULT_BATCH, DEFAULT_MAX_REPLY_MB, RemoteReward, is_remote


@dataclass
class RewardSpec:
    """One reward function: a built-in name, `path/to/file.py:func` (optionally `@trl`/`@verl`/`@openrlhf`/
    `@batched`/`@sample` to force a calling convention), a reward server's URL (`http(s)://...`, named `remote`),
    or a callable; its weight and its logging name."""

    source: str | Callable
    weight: float = 1.0
    name: str = ""
    style: str | None = None  # None: detected from the signature

    def __post_init__(self):
        if is_remote(self.source):
            self.source, self.style = self.source.strip(), "batched"
        elif isinstance(self.source, str):  # a file's path made absolute now, before any user code is imported
            self.source, forced = split_style(absolute_spec(self.source.strip()))
            self.style = self.style or forced
        if self.style is not None and self.style not in STYLES:
            raise ValueError(f"reward style must be one of {STYLES}, got {self.style!r}")
        if not math.isfinite(float(self.weight)):
            raise ValueError(f"reward weight must be finite, got {self.weight}")
        self.weight = float(self.weight)
        if not self.name:
            src = self.source
            if is_remote(src):
                self.name = "remote"
            elif isinstance(src, str):
                self.name = src if src in BUILTIN_REWARDS else src.rsplit(":", 1)[-1]
            else:
                self.name = getattr(src, "__name__", type(src).__name__)


def parse_weights(weights: str | Sequence[float] | None, count: int) -> list[float]:
    """`None`/`""` -> all 1.0; `"1,0.5"` or `[1, 0.5]` -> one weight per function."""
    if weights is None or weights == "":
        return [1.0] * count
    try:
        values = [float(w) for w in (weights.split(",") if isinstance(weights, str) else weights)]
    except ValueError:
        raise ValueError(f"reward.weights={weights!r} is not a comma-separated list of numbers") from None
    if len(values) != count:
        raise ValueError(f"reward.weights={weights!r}: {len(values)} reward weight(s) for {count} reward "
                         "function(s): give one weight per function")
    return values


class RewardSet:
    """Weighted reward functions. `workers=0`: called in this process (user code is imported here), with no timeout
    for a plain function; an `async def` one is awaited for at most `timeout` seconds.
    `workers>0`: a pool of that many spawn/forkserver processes, started now and kept for the whole run; each call
    is cut off after `timeout` seconds, and the user file is imported only by the workers. Call `close()` at the end.
    A reward server's URL is always asked from this process (its requests are I/O, with their own `timeout` each,
    in requests of at most `http_batch` items, replies of at most `http_max_reply_mb` MiB; see remote.py), and a
    callable given in Python (`python:NAME`, `loading.register`) and a source marked `in_process` (the LLM judge,
    judge.py) run in this process; only the other functions go to the pool.
    """

    def __init__(self, specs: Sequence[RewardSpec], workers: int = 0, timeout: float = 30.0,
                 mp_context: str = "spawn", import_timeout: float = START_TIMEOUT_S,
                 announce: Callable[[str], object] | None = print, http_batch: int = DEFAULT_BATCH,
                 http_max_reply_mb: float = DEFAULT_MAX_REPLY_MB):
        if not specs:
            raise ValueError("a RewardSet needs at least one reward function")
        seen: dict[str, int] = {}
        self.specs = []
        for spec in specs:  # unique logging names: gsm8k, gsm8k_2, ...
            seen[spec.name] = seen.get(spec.name, 0) + 1
            self.specs.append(spec if seen[spec.name] == 1 else replace(spec, name=f"{spec.name}_{seen[spec.name]}"))
        # the members the pool runs, in pool order (a URL never: this process asks the server; nor a callable given
        # in Python as `python:NAME`, which no worker process has)
        self._pooled = [m for m, s in enumerate(self.specs) if not is_remote(s.source)
                        and not getattr(s.source, "in_process", False)
                        and not (isinstance(s.source, str) and registered(s.source) is not None)] if workers > 0 else []
        self.pool = None
        self.styles: list[str | None] = [None] * len(self.specs)
        if self._pooled:
            for m in self._pooled:  # the cheap checks here, with the in-process errors; the import in the workers
                source = self.specs[m].source
                if isinstance(source, str) and source not in BUILTIN_REWARDS:
                    check_spec(source)
            self.pool = RewardPool([(self.specs[m].source, self.specs[m].style) for m in self._pooled], workers,
                                   timeout, mp_context, start_timeout=import_timeout, announce=announce)
            for m, style in zip(self._pooled, self.pool.wait_ready()):  # fail fast on a bad file; start cost once
                self.styles[m] = style
        self._calls = {}
        for m, spec in enumerate(self.specs):
            if m in self._pooled:
                continue
            if is_remote(spec.source):
                fn = RemoteReward(spec.source, batch_size=http_batch, timeout=timeout,
                                  max_reply_bytes=int(http_max_reply_mb * (1 << 20)))
            else:
                fn = load_reward_fn(spec.source) if isinstance(spec.source, str) else spec.source
            self.styles[m] = spec.style or detect_style(fn)
            self._calls[m] = make_call(fn, self.styles[m])
        self.timeout = float(timeout)  # in-process: bounds an `async def` function's wait (a sync call runs to its end)

    @classmethod
    def from_spec(cls, spec: str, weights: str | Sequence[float] | None = None, **kwargs) -> RewardSet:
        """`"gsm8k"`, `"my.py:f"`, `"gsm8k,my.py:f@trl"` plus weights (see parse_weights); kwargs as __init__."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError("empty reward function spec")
        return cls([RewardSpec(p, w) for p, w in zip(parts, parse_weights(weights, len(parts)))], **kwargs)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.specs]

    def evaluate(self, items: list[dict]) -> list[list[Outcome]]:
        """Per function, one outcome per item: batched styles get one call per batch, others one per sample."""
        if not items:
            return [[] for _ in self.specs]
        calls = []
        for m, style in enumerate(self.styles):
            calls += [(m, items)] if style in BATCHED_STYLES else [(m, [it]) for it in items]
        pooled = [(self._pooled.index(m), chunk) for m, chunk in calls if m not in self._calls]
        from_pool = iter(self.pool.run(pooled) if pooled else [])
        done = [invoke(self._calls[m], chunk, in_worker=False, timeout=self.timeout) if m in self._calls
                else next(from_pool) for m, chunk in calls]
        per_member: list[list[Outcome]] = [[] for _ in self.specs]
        for (m, _), outcomes in zip(calls, done):
            per_member[m] += outcomes
        return per_member

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_rewards(spec: str):
    """The reward of a spec: one function (`loading.load_reward_fn`), or for a spec naming several (`gsm8k,my.py:f`)
    an in-process RewardSet with weights 1, which `score_samples` accepts like a function."""
    return RewardSet.from_spec(spec) if "," in spec else load_reward_fn(spec)
