"""The numbers of held-out evaluation (`rl_eval.evaluate`): the unbiased pass@k estimator, one prompt's stats, and
tallies of sums per data source ("" = the whole eval set) that merge over ranks into the `eval/...` metrics (see
`rl_eval`'s module docstring for each metric).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

_OVERALL = ""  # the tally key of the whole eval set


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a product (no huge binomials).

    C(n-c, k) / C(n, k) = prod_{i=0}^{k-1} (n-c-i) / (n-i) = prod_{j=n-c+1}^{n} (1 - k/j).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for j in range(n - c + 1, n + 1):
        miss *= 1.0 - k / j
    return 1.0 - miss


def prompt_stats(rewards: Sequence[float], threshold: float, ks: Sequence[int]) -> dict[str, float]:
    """One prompt's `reward_mean`, `pass@k` and `mean@k` (k in `ks`, each <= len(rewards)) from its n rewards."""
    n = len(rewards)
    c = sum(1 for r in rewards if r >= threshold)
    out = {"reward_mean": sum(rewards) / n}
    for k in ks:
        out[f"pass@{k}"] = pass_at_k(n, c, k)
        out[f"mean@{k}"] = sum(rewards[:k]) / k
    return out


def tally_parts(tally: dict[str, dict[str, float]], parts: dict[str, list[float | None]]) -> None:
    """Add each reward part's sum and count over the samples that have it to the overall tally (mergeable over
    ranks), so `eval/reward/<function>` and `eval/reward/<function>/<metric>` report their means."""
    acc = tally.setdefault(_OVERALL, {})
    for name, values in parts.items():
        present = [v for v in values if v is not None]
        acc[f"part_sum:{name}"] = acc.get(f"part_sum:{name}", 0.0) + float(sum(present))
        acc[f"part_n:{name}"] = acc.get(f"part_n:{name}", 0.0) + float(len(present))


def tally_samples(samples, rewards, bad, rows, threshold, ks) -> dict[str, dict[str, float]]:
    """Per data source ("" = all): sums of the per-prompt stats and of the per-sample counts, mergeable over ranks."""
    by_prompt: dict[int, list[int]] = {}
    for pos, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_index, []).append(pos)
    tally: dict[str, dict[str, float]] = {}
    for prompt_index, positions in by_prompt.items():
        positions.sort(key=lambda p: samples[p].sample_index)
        stats = prompt_stats([rewards[p] for p in positions], threshold, ks)
        stats["prompts"] = 1.0
        stats["samples"] = float(len(positions))
        stats["bad"] = float(sum(bad[p] for p in positions))
        stats["response_len"] = float(sum(len(samples[p].response_ids) for p in positions))
        stats["truncated"] = float(sum(samples[p].finish_reason == "length" for p in positions))
        episodes = [samples[p].episode for p in positions if samples[p].episode is not None]
        if episodes:
            stats["episodes"] = float(len(episodes))
            stats["episode_turns"] = float(sum(e["turns"] for e in episodes))
            stats["episode_tool_turns"] = float(sum(e["tool_turns"] for e in episodes))
            stats["episode_truncated"] = float(sum(bool(e["truncated"]) for e in episodes))
        source = str(rows[prompt_index].get("data_source") or "unknown")
        for key in (_OVERALL, source):
            acc = tally.setdefault(key, {})
            for name, value in stats.items():
                acc[name] = acc.get(name, 0.0) + value
    return tally


def gather_tallies(tally: dict) -> list[dict]:
    """Every rank's tally (this rank's alone without torch.distributed or with one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [tally]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tally)
    return out


def merge_tallies(tallies: list[dict]) -> dict[str, dict[str, float]]:
    """The ranks' tallies summed per data source and name."""
    merged: dict[str, dict[str, float]] = {}
    for tally in tallies:
        for source, sums in tally.items():
            acc = merged.setdefault(source, {})
            for name, value in sums.items():
                acc[name] = acc.get(name, 0.0) + value
    return merged


_PER_PROMPT = ("reward_mean",)  # plus every pass@k / mean@k


def tally_metrics(merged: dict[str, dict[str, float]]) -> dict[str, float]:
    """The `eval/...` metrics of merged tallies: per-prompt stats averaged over prompts, per-sample counts over
    samples; each also per data source, the reward parts and episode figures overall only."""
    out: dict[str, float] = {}
    for source in sorted(merged):
        sums = merged[source]
        prompts = sums.get("prompts", 0.0)
        if not prompts:
            continue
        prefix = "eval/" if source == _OVERALL else f"eval/{source}/"
        for name, value in sums.items():
            if name in _PER_PROMPT or name.startswith(("pass@", "mean@")):
                out[prefix + name] = value / prompts
        out[prefix + "prompts"] = prompts
        if source == _OVERALL:
            for name, total in sums.items():
                if name.startswith("part_sum:") and sums.get("part_n:" + name[9:]):
                    out["eval/reward/" + name[9:]] = total / sums["part_n:" + name[9:]]
            samples = max(sums["samples"], 1.0)
            out.update({"eval/samples": sums["samples"], "eval/bad": sums["bad"],
                        "eval/response_len_mean": sums["response_len"] / samples,
                        "eval/truncated_frac": sums["truncated"] / samples})
            if episodes := sums.get("episodes", 0.0):
                out.update({"eval/episode/turns_mean": sums["episode_turns"] / episodes,
                            "eval/episode/tool_call_rate": sums["episode_tool_turns"] / max(sums["episode_turns"], 1.0),
                            "eval/episode/truncated_frac": sums["episode_truncated"] / episodes})
    return out
