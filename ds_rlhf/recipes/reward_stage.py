"""The reward stage of an RL step: RolloutBatch -> ScoredBatch.

Scores rollout samples with the reward model or the reward function(s), applies the bad-reward policy (fail /
zero / drop, see `rewards.py`) and, to multi-turn episodes the environment failed, the bad-tool policy
(`env.on_bad_tool`: fail / zero / drop), computes the reward metrics, then shapes the scores (DAPO's soft overlong
penalty, `rl.overlong_buffer`). `ScoredBatch.raw_scores` keeps the unshaped ones (dynamic sampling tests their
spread; the `reward/...` metrics describe them); `ScoredBatch.scores` are the shaped ones the update trains on. It
builds nothing: the reward model (a frozen DeepSpeed engine) is built with the other roles in `rl_build.py` and
handed in.

The reward model reads each prompt + response at its score token, by the rule RM training read its pairs with
(`engines/rm_scoring.py`, from the run's tokenizer): a response stopped at the end-of-turn token is scored there, a
truncated one gets the end-of-turn token appended.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_rlhf.agent.episode import BadToolError
from ds_rlhf.algos.shaping import group_spread, overlong_penalty
from ds_rlhf.data.convert import row_prompt_messages
from ds_rlhf.distributed import agree_max
from ds_rlhf.engines.rm_scoring import ScoreRule, score_rule
from ds_rlhf.recipes.batching import pad_scored
from ds_rlhf.recipes.trajectory import RolloutBatch, ScoredBatch
from ds_rlhf.rewards import BadRewardError, RewardFn, gsm8k_reward, score_samples
from ds_rlhf.rewards.reward_set import RewardSet
from ds_rlhf.rollout.base import RolloutSample
from ds_rlhf.run.context import RunContext


def score_stats(scores: list[float]) -> dict:
    """reward/mean, std, max, min of raw sequence rewards (zeros for none)."""
    t = torch.tensor(scores, dtype=torch.float64) if scores else torch.zeros(1, dtype=torch.float64)
    return {"reward/mean": float(t.mean()), "reward/std": float(t.std()) if len(t) > 1 else 0.0,
            "reward/max": float(t.max()), "reward/min": float(t.min())}


ZERO_SPREAD_TOL = 1e-6  # as dynamic sampling's informative_groups: a spread at most this is no spread


def zero_std_stats(samples, scores: list[float]) -> dict:
    """`reward/frac_zero_std`: the share of prompt groups (two or more kept samples) whose raw rewards are all
    equal, so their group-relative advantages are zero; empty when no prompt has two samples."""
    if not samples:
        return {}
    ids = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    spread, count = group_spread(torch.tensor(scores, dtype=torch.float64), ids, int(ids.max()) + 1)
    grouped = count >= 2
    if not bool(grouped.any()):
        return {}
    return {"reward/frac_zero_std": float((spread[grouped] <= ZERO_SPREAD_TOL).double().mean())}


_SUMMED = ("reward/bad", "reward/dropped")


def merge_reward_metrics(rounds: list[ScoredBatch]) -> dict:
    """The reward metrics of several scoring rounds of one step (dynamic sampling) as if their samples had been
    scored together: mean/std/max/min over every kept sample's raw reward, counts summed, exact match weighted by
    the round's samples, other means by its kept samples."""
    out: dict = {}
    weights: dict[str, float] = {}
    for scored in rounds:
        for key, value in scored.metrics.items():
            if key in _SUMMED:
                out[key] = out.get(key, 0.0) + float(value)
            elif key == "reward/bad_total":
                out[key] = float(value)
            else:
                w = float(len(scored.rollout.samples) if key == "reward/exact_match" else len(scored.samples))
                out[key] = out.get(key, 0.0) + float(value) * w
                weights[key] = weights.get(key, 0.0) + w
    for key, w in weights.items():
        out[key] = out[key] / w if w > 0 else 0.0
    out.update(score_stats([v for scored in rounds for v in scored.raw()]))
    return out


def reward_items(samples: list[RolloutSample], rows: list[dict], texts: list[str],
                 id_of: Callable[[RolloutSample, dict], str]) -> list[dict]:
    """What a reward function is given per sample (`rewards.calling`): the prompt text, the response, the ground
    truth, metadata, an id and, for a conversational prompt, its chat messages."""
    items = []
    for s, text in zip(samples, texts):
        row = rows[s.prompt_index]
        item = {"prompt": row.get("prompt_text") or "", "response": text, "ground_truth": row.get("ground_truth"),
                "metadata": {"data_source": row.get("data_source"), "finish_reason": s.finish_reason},
                "id": id_of(s, row)}
        if (messages := row_prompt_messages(row)) is not None:
            item["prompt_messages"] = messages
        items.append(item)
    return items


TOOL_FAILURES = ("error", "timeout", "cpu_limit", "memory", "crashed")  # report statuses of a failed call or step


def episode_stats(samples: list[RolloutSample]) -> dict:
    """`episode/...` metrics of the samples that are multi-turn episodes (`RolloutSample.episode`): generated turns
    per episode, the share of turns that called a tool, the share a budget truncated, the environment's mean
    reward and mean per-step reward (`turn_reward_mean`, over every environment step that returned), the share
    that ended on an error (an environment or reset that raised), the share the environment failed (`bad_frac`:
    raised, passed `env.step_timeout` or returned an oversized observation: what `env.on_bad_tool` applies to),
    and the shares with at least one report of a failed tool call or step (`tool_error_frac`: raised, crashed, or
    a sandbox limit or deadline) and of a timeout (`tool_timeout_frac`: the sandbox's or `env.step_timeout`).
    Empty for none."""
    eps = [s.episode for s in samples if s.episode is not None]
    if not eps:
        return {}
    turns = sum(e["turns"] for e in eps)
    steps = [r for e in eps for r in e.get("turn_rewards", [])]

    def share(test) -> float:
        return sum(bool(test(e)) for e in eps) / len(eps)

    return {"episode/turns_mean": turns / len(eps),
            "episode/tool_call_rate": sum(e["tool_turns"] for e in eps) / max(turns, 1),
            "episode/truncated_frac": share(lambda e: e["truncated"]),
            "episode/reward_mean": sum(e["reward"] for e in eps) / len(eps),
            "episode/turn_reward_mean": sum(steps) / len(steps) if steps else 0.0,
            "episode/error_frac": share(lambda e: e["end"] == "error"),
            "episode/bad_frac": share(lambda e: e.get("bad")),
            "episode/tool_error_frac": share(lambda e: any(r.get("status") in TOOL_FAILURES
                                                           for r in e.get("reports", []))),
            "episode/tool_timeout_frac": share(lambda e: any(r.get("status") == "timeout"
                                                             for r in e.get("reports", [])))}


def bad_episode(sample: RolloutSample) -> bool:
    """The sample is an episode its environment failed (`Episode.bad`)."""
    return sample.episode is not None and bool(sample.episode.get("bad"))


class RewardStage:
    """Scores rollout samples with reward functions, the reward model, or both (`reward.model_weight` x the RM
    score + the functions' weighted sum), and applies the bad-reward policy to the functions' rewards.

    A multi-turn episode (`env.name`) brings its environment's reward (`RolloutSample.episode["reward"]`):
    it is the sample's reward, with the reward functions' and the reward model's scores added when those are set
    too. An episode the environment failed (`bad_episode`) is handled by `env.on_bad_tool`: `fail` stops the run
    with its report, `zero` scores it 0 (every part of its reward), `drop` leaves it out of the step."""

    def __init__(self, ctx: RunContext, *, fn: RewardSet | RewardFn | None = None, model=None):
        if fn is None and model is None and not ctx.cfg.rl.teacher and not ctx.cfg.env.name:
            raise ValueError("RewardStage needs a reward function, a reward model or both (or rl.teacher, or "
                             "env.name)")
        self.ctx, self.fn, self.model = ctx, fn, model
        self._rule: ScoreRule | None = None  # the reward model's score rule, from ctx.tokenizer at the first scoring
        self.bad_total = 0

    def __call__(self, batch: RolloutBatch, step: int) -> ScoredBatch:
        samples, rows = batch.samples, batch.rows
        tok = self.ctx.tokenizer
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]  # decoded once per step
        scores, keep, bad, components, report = [0.0] * len(samples), [True] * len(samples), [], {}, None
        if self.fn is not None:
            items = reward_items(samples, rows, texts, lambda s, row: f"step{step}/rank{self.ctx.dist.rank}/row"
                                 f"{row.get('row_id')}/sample{s.sample_index}")
            report = score_samples(self.fn, items, self.ctx.cfg.reward.on_bad)
            scores, keep, bad, components = list(report.scores), report.keep, report.bad, report.components
        scores, model_scores = self.combined(samples, scores if report is not None else None)
        keep = self._bad_tool_policy(samples, rows, keep)
        self._stop_if_all_bad(bad, len(samples))
        self.bad_total += len(bad)
        for sample_id, reason in bad[:3]:
            print(f"[reward] bad reward for {sample_id}: {reason} (policy {self.ctx.cfg.reward.on_bad})")
        exact = self._exact_match(samples, texts, rows)
        kept = [s for s, k in zip(samples, keep) if k]
        kept_scores = [v for v, k in zip(scores, keep) if k]
        metrics = {**score_stats(kept_scores), **zero_std_stats(kept, kept_scores), "reward/bad": float(len(bad)),
                   "reward/bad_total": float(self.bad_total), "reward/dropped": float(len(samples) - len(kept))}
        if report is not None and (self.model is not None or isinstance(self.fn, RewardSet) and len(self.fn.specs) > 1):
            metrics.update(report.means())  # reward/<function> for each of several functions (or beside the RM)
        metrics.update(report.means(extras_only=True) if report is not None else {})  # reward/<function>/<metric>
        if model_scores is not None and self.fn is not None:
            kept_model = [m for m, k in zip(model_scores, keep) if k]
            metrics["reward/model"] = sum(kept_model) / max(1, len(kept_model))
        if exact is not None:
            metrics["reward/exact_match"] = exact
        metrics.update(episode_stats(samples))
        shaped, shaping = self._shape(kept, kept_scores)
        metrics.update(shaping)
        return ScoredBatch(rollout=batch, samples=kept, scores=shaped, metrics=metrics,
                           texts=[t for t, k in zip(texts, keep) if k],
                           components={name: [v for v, k in zip(values, keep) if k]
                                       for name, values in components.items()},
                           raw_scores=kept_scores)

    def combined(self, samples: list[RolloutSample],
                 fn_scores: list[float] | None) -> tuple[list[float], list[float] | None]:
        """The sequence reward training gives each sample, from its reward functions' scores (`fn_scores`, None
        without functions): plus the reward model's score (x `reward.model_weight` beside functions), plus an
        episode's environment reward (`RolloutSample.episode["reward"]`). Returns it and the reward model's scores
        (None without a reward model). Held-out evaluation of episodes scores with it too (`rl_eval.evaluate`)."""
        scores = list(fn_scores) if fn_scores is not None else [0.0] * len(samples)
        model_scores = None
        if self.model is not None:
            model_scores = self._model_scores(samples)
            weight = self.ctx.cfg.reward.model_weight if fn_scores is not None else 1.0
            scores = [v + weight * m for v, m in zip(scores, model_scores)]
        if any(s.episode is not None for s in samples):  # the environment's reward, plus the above when set
            scores = [v + (s.episode["reward"] if s.episode is not None else 0.0) for v, s in zip(scores, samples)]
            scores = [0.0 if bad_episode(s) else v for v, s in zip(scores, samples)]  # env.on_bad_tool zero / drop
        return scores, model_scores

    def _bad_tool_policy(self, samples: list[RolloutSample], rows: list[dict], keep: list[bool]) -> list[bool]:
        """`env.on_bad_tool` on the episodes the environment failed: `fail` raises `BadToolError` with the first
        one's report, `drop` takes them out of `keep` (every sample bad: stop, nothing to train on), `zero` keeps
        them (`combined` scored them 0)."""
        bad = [i for i, s in enumerate(samples) if bad_episode(s)]
        if not bad:
            return keep
        policy = self.ctx.cfg.env.on_bad_tool
        s = samples[bad[0]]
        reports = [r for r in s.episode.get("reports", []) if r.get("status") in (*TOOL_FAILURES, "oversized")]
        why = (f"episode {s.sample_index} of prompt row {rows[s.prompt_index].get('row_id')} ended "
               f"'{s.episode['end']}'" + (f" ({reports[-1].get('error')})" if reports else ""))
        if policy == "fail":
            raise BadToolError(f"env.name={self.ctx.cfg.env.name}: {why}; {len(bad)} such episode(s) "
                               "this step (env.on_bad_tool fail): fix the environment, raise --env.step_timeout, "
                               "or set --env.on_bad_tool zero or drop")
        print(f"[episode] {len(bad)} episode(s) failed by the environment, e.g. {why} (env.on_bad_tool {policy})")
        if policy == "drop":
            keep = [k and i not in bad for i, k in enumerate(keep)]
            if not any(keep):
                raise BadToolError(f"env.name={self.ctx.cfg.env.name}: every episode of this step "
                                   f"failed in the environment, e.g. {why}: nothing to train on (env.on_bad_tool "
                                   "drop); fix the environment or raise --env.step_timeout")
        return keep

    def _shape(self, samples, raw: list[float]) -> tuple[list[float], dict]:
        """The shaped scores (raw + DAPO's soft overlong penalty, `rl.overlong_buffer`) and their metrics. The raw
        scores stay beside them: dynamic sampling and the reward metrics read those."""
        rl, budget = self.ctx.cfg.rl, self.ctx.cfg.rollout.max_new_tokens
        if rl.overlong_buffer <= 0 or not samples:
            return list(raw), {}
        penalty = overlong_penalty(torch.tensor([len(s.response_ids) for s in samples]), budget,
                                   rl.overlong_buffer, rl.overlong_penalty)
        shaped = (torch.tensor(raw, dtype=torch.float64) + penalty.double()).tolist()
        return shaped, {"reward/overlong_penalty": float(penalty.mean()),
                        "reward/overlong_frac": float((penalty < 0).float().mean()),
                        "reward/shaped_mean": sum(shaped) / len(shaped)}

    def close(self) -> None:
        if isinstance(self.fn, RewardSet):
            self.fn.close()

    def _stop_if_all_bad(self, bad: list, n: int) -> None:
        """A step whose every reward is bad has nothing to learn from (any policy): stop, on every rank together."""
        everything_bad = int(n > 0 and len(bad) == n)
        if agree_max(everything_bad, self.ctx.dist.device):
            where = f"all {n} samples on this rank" if everything_bad else "every sample on another rank"
            example = f"; e.g. {bad[0][0]}: {bad[0][1]}" if bad else ""
            raise BadRewardError(f"every reward of this step was bad ({where}){example}: stopping "
                                 "(fix the reward function; no policy can train on this)")

    def _exact_match(self, samples, texts: list[str], rows: list[dict]) -> float | None:
        """GSM8K-style exact-match rate, logged whenever the prompts carry ground truth (monitoring only)."""
        truths = [rows[s.prompt_index].get("ground_truth") for s in samples]
        if not samples or any(t is None for t in truths):
            return None
        return sum(gsm8k_reward("", text, truth, {}) for text, truth in zip(texts, truths)) / len(samples)

    @torch.no_grad()
    def _model_scores(self, samples) -> list[float]:
        if self._rule is None:
            self._rule = score_rule(self.ctx.tokenizer)
        seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
        bs = max(1, self.ctx.cfg.optim.micro_batch_size)
        out = []
        for i in range(0, len(seqs), bs):
            ids, attn = pad_scored(seqs[i : i + bs], self._rule, self.ctx.tokenizer.pad_token_id, self.ctx.dist.device)
            out.extend(self.model(input_ids=ids, attention_mask=attn).float().cpu().tolist())
        return out
