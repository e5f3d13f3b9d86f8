"""RewardSpec / RewardSet: one or several weighted reward functions, run in-process or in a worker pool."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ds_rlhf.rewards.builtin import BUILTIN_REWARDS
from ds_rlhf.rewards.calling import BATCHED_STYLES, Outcome, detect_style, invoke, make_call
from ds_rlhf.rewards.loading import STYLES, check_spec, load_reward_fn, split_style
from ds_rlhf.rewards.pool import START_TIMEOUT_S, RewardPool


@dataclass
class RewardSpec:
    """One reward function: a built-in name, `path/to/file.py:func` (optionally `@trl`/`@verl`/`@openrlhf`/
    `@batched`/`@sample` to force a calling convention), or a callable; its weight and its logging name."""

    source: str | Callable
    weight: float = 1.0
    name: str = ""
    style: str | None = None  # None: detected from the signature

    def __post_init__(self):
        if isinstance(self.source, str):
            self.source, forced = split_style(self.source.strip())
            self.style = self.style or forced
        if self.style is not None and self.style not in STYLES:
            raise ValueError(f"reward style must be one of {STYLES}, got {self.style!r}")
        if not math.isfinite(float(self.weight)):
            raise ValueError(f"reward weight must be finite, got {self.weight}")
        self.weight = float(self.weight)
        if not self.name:
            src = self.source
            if isinstance(src, str):
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
        raise ValueError(f"rl.reward_weights={weights!r} is not a comma-separated list of numbers") from None
    if len(values) != count:
        raise ValueError(f"rl.reward_weights={weights!r}: {len(values)} reward weight(s) for {count} reward "
                         "function(s): give one weight per function")
    return values


class RewardSet:
    """Weighted reward functions. `workers=0`: called in this process (user code is imported here), with no timeout
    for a plain function; an `async def` one is awaited for at most `timeout` seconds.
    `workers>0`: a pool of that many spawn/forkserver processes, started now and kept for the whole run; each call
    is cut off after `timeout` seconds, and the user file is imported only by the workers. Call `close()` at the end.
    """

    def __init__(self, specs: Sequence[RewardSpec], workers: int = 0, timeout: float = 30.0,
                 mp_context: str = "spawn", import_timeout: float = START_TIMEOUT_S,
                 announce: Callable[[str], object] | None = print):
        if not specs:
            raise ValueError("a RewardSet needs at least one reward function")
        seen: dict[str, int] = {}
        self.specs = []
        for spec in specs:  # unique logging names: gsm8k, gsm8k_2, ...
            seen[spec.name] = seen.get(spec.name, 0) + 1
            self.specs.append(spec if seen[spec.name] == 1 else replace(spec, name=f"{spec.name}_{seen[spec.name]}"))
        self.pool = None
        if workers > 0:
            for spec in self.specs:  # the cheap checks here, with the in-process errors; the import in the workers
                if isinstance(spec.source, str) and spec.source not in BUILTIN_REWARDS:
                    check_spec(spec.source)
            self.pool = RewardPool([(s.source, s.style) for s in self.specs], workers, timeout, mp_context,
                                   start_timeout=import_timeout, announce=announce)
            self.styles = self.pool.wait_ready()  # fail fast on a bad file; pays the start cost once, here
            self._calls = None
        else:
            fns = [load_reward_fn(s.source) if isinstance(s.source, str) else s.source for s in self.specs]
            self.styles = [s.style or detect_style(fn) for s, fn in zip(self.specs, fns)]
            self._calls = [make_call(fn, style) for fn, style in zip(fns, self.styles)]
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
        if self.pool is not None:
            done = self.pool.run(calls)
        else:
            done = [invoke(self._calls[m], chunk, in_worker=False, timeout=self.timeout) for m, chunk in calls]
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
