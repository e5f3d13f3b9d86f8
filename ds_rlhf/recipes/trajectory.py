"""The values that flow through one RL step, each made by one stage and never written to by another:

    prompt rows --rollout--> RolloutBatch --rewards--> ScoredBatch --pad + forward passes + advantages--> Trajectory

A `Trajectory` is frozen: a stage that adds log-probs, values or advantages returns a new one (`replace`).

Layout: each row is prompt + response, right-padded to the batch's longest row. Per-token tensors have length
L-1 and are indexed by the position that *predicts* the token: position t scores token t+1, so
`action_mask[:, t]` is 1 exactly when token t+1 is a response token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from itertools import chain

import numpy as np
import torch

from ds_rlhf.algos.advantages import compute_advantages, estimator_inputs, token_rewards_from_scores
from ds_rlhf.algos.kl import kl_penalty
from ds_rlhf.algos.shaping import truncated_rows
from ds_rlhf.config import RLConfig
from ds_rlhf.rollout.base import RolloutBatch, RolloutSample


@dataclass(frozen=True)
class ScoredBatch:
    """The samples that go on to training (the bad-reward policy may drop some), their rewards and reward metrics."""

    rollout: RolloutBatch
    samples: list[RolloutSample]
    scores: list[float]  # one sequence reward per kept sample, shaped (raw + overlong penalty): what trains
    metrics: dict = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # the kept samples' decoded responses (decoded once, for rewards)
    components: dict[str, list] = field(default_factory=dict)  # each reward function's score per kept sample
    raw_scores: list[float] = field(default_factory=list)  # the reward functions' weighted score, before shaping

    def raw(self) -> list[float]:
        """The raw sequence rewards (the shaped ones where a caller built the batch without them)."""
        return self.raw_scores if len(self.raw_scores) == len(self.samples) else self.scores


@dataclass(frozen=True)
class Trajectory:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    action_mask: torch.Tensor  # [B, L-1] float
    rollout_logp: torch.Tensor  # [B, L-1] float, log-probs the rollout engine sampled with
    scores: torch.Tensor  # [B] float, sequence rewards
    prompt_lens: torch.Tensor  # [B] long
    response_lens: torch.Tensor  # [B] long
    group_ids: torch.Tensor  # [B] long, index of the prompt the sample answers
    old_logp: torch.Tensor | None = None  # the pre-update policy's (only when several updates use one batch)
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None  # [B, L-1] float, episodes' per-step rewards at their turns' ends
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weights_version: int = 0  # the oldest weights version of its rows
    weights_versions: torch.Tensor | None = None  # [B] long, each row's weights version (its sample's)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def replace(self, **changes) -> Trajectory:
        return dataclasses.replace(self, **changes)

    def behaviour_logp(self) -> torch.Tensor:
        """The behaviour policy's log-probs: the trainer's own when computed, else the rollout engine's."""
        return self.old_logp if self.old_logp is not None else self.rollout_logp

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    def select(self, index: list[int] | torch.Tensor) -> Trajectory:
        """Rows `index`, trimmed to their own longest sequence (less padding per micro-batch)."""
        index = torch.as_tensor(index, dtype=torch.long)
        width = int(self.seq_lens[index].max())
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[index.to(value.device)]
                if value.dim() == 2:
                    value = value[:, : width if value.shape[1] == self.input_ids.shape[1] else width - 1]
            out[f.name] = value
        return Trajectory(**out)

    def to(self, device) -> Trajectory:
        return Trajectory(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})


def pad_trajectory(samples: list[RolloutSample], scores: list[float], pad_id: int, device="cpu",
                   weights_version: int = 0, mask_truncated: bool = False) -> Trajectory:
    """Pad `RolloutSample`s (prompt_ids, response_ids, logprobs, prompt_index) into a Trajectory.

    `attention_mask` and `action_mask` come from each sample's prompt and response lengths, never from comparing
    ids with `pad_id`, which only fills the right padding: a response's final stop token (EOS, end-of-turn) is
    attended, trained on and in the mismatch metrics even where the tokenizer's pad id equals it.

    A sample with a `loss_mask` (a multi-turn episode) acts on its generated tokens only: its observation tokens'
    `action_mask` entries are 0, so the policy loss, the KL and the entropy never read them.

    An episode's per-step rewards (`episode["turn_rewards"]`, one per environment step that returned) go into
    `step_rewards` at the position predicting the last token of the turn that step answered (`turn_reward_positions`);
    the score keeps the whole reward, and `shaped_token_rewards` puts only the rest of it on the last token.

    `mask_truncated` (DAPO's overlong filtering, `rl.overlong_mask`): a response that hit the generation budget
    (`finish_reason == "length"`) gets an all-zero `action_mask` row, so it carries no loss weight (nor counts
    in token-mean's denominator); its score still enters its group's baseline (`with_advantages`)."""
    if not samples:
        raise ValueError("no rollout samples to train on")
    # Vectorised: one flat array per field, scattered through boolean masks in row-major order (each row's tokens
    # are consecutive), instead of a tensor per row: 256 x 384 tokens took ~0.1 s of host time per step that way.
    p_lens = np.fromiter((len(s.prompt_ids) for s in samples), dtype=np.int64, count=len(samples))
    r_lens = np.fromiter((len(s.response_ids) for s in samples), dtype=np.int64, count=len(samples))
    if (p_lens < 1).any():
        raise ValueError(f"sample {int(np.argmin(p_lens))} has an empty prompt: the first response token needs a "
                         "prompt token to be predicted from")
    for row, s in enumerate(samples):
        if len(s.logprobs) != r_lens[row]:
            raise ValueError(f"sample {row}: {r_lens[row]} response tokens but {len(s.logprobs)} log-probs")
    seq_lens = p_lens + r_lens
    width, batch = int(seq_lens.max()), len(samples)
    cols = np.arange(width)
    filled = cols[None, :] < seq_lens[:, None]  # [B, L]
    ids = np.fromiter(chain.from_iterable(chain(s.prompt_ids, s.response_ids) for s in samples), dtype=np.int64,
                      count=int(seq_lens.sum()))
    input_ids = np.full((batch, width), pad_id, dtype=np.int64)
    input_ids[filled] = ids
    # position t predicts token t+1: the response's tokens are predicted at positions p-1 .. p+r-2
    acting = (cols[None, : width - 1] >= p_lens[:, None] - 1) & (cols[None, : width - 1] < seq_lens[:, None] - 1)
    rollout_logp = np.zeros((batch, width - 1), dtype=np.float32)
    rollout_logp[acting] = np.fromiter(chain.from_iterable(s.logprobs for s in samples), dtype=np.float32,
                                       count=int(r_lens.sum()))
    if any(s.loss_mask is not None for s in samples):  # episodes: observation tokens are not the policy's actions
        acting[acting] = _loss_mask_values(samples, r_lens)
    if mask_truncated:
        acting &= ~truncated_rows([s.finish_reason for s in samples]).numpy()[:, None]
    return Trajectory(
        input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(filled.astype(np.int64)),
        action_mask=torch.from_numpy(acting.astype(np.float32)), rollout_logp=torch.from_numpy(rollout_logp),
        scores=torch.tensor(scores, dtype=torch.float32), prompt_lens=torch.from_numpy(p_lens),
        response_lens=torch.from_numpy(r_lens),
        group_ids=torch.tensor([s.prompt_index for s in samples], dtype=torch.long), weights_version=weights_version,
        weights_versions=torch.tensor([weights_version if s.weights_version is None else s.weights_version
                                       for s in samples], dtype=torch.long),
        step_rewards=_step_rewards(samples, p_lens, width),
    ).to(device)


def staleness_metrics(traj: Trajectory, step: int) -> dict:
    """How far off-policy step `step`'s batch is, in trainer updates between a row's weights and the trainer's
    (`step`): `rollout/staleness` from the batch's oldest weights, `rollout/staleness_mean` and
    `rollout/staleness_max` over the rows, each from its own sample's weights version."""
    versions = traj.weights_versions if traj.weights_versions is not None else \
        torch.full((len(traj),), traj.weights_version, dtype=torch.long)
    ages = (step - versions).float()
    return {"rollout/staleness": step - traj.weights_version, "rollout/staleness_mean": ages.mean(),
            "rollout/staleness_max": ages.max()}


def _loss_mask_values(samples: list[RolloutSample], r_lens: np.ndarray) -> np.ndarray:
    """Every response token's `loss_mask` entry in row-major order, as booleans (1 for a sample without a mask)."""
    for row, s in enumerate(samples):
        if s.loss_mask is not None and len(s.loss_mask) != r_lens[row]:
            raise ValueError(f"sample {row}: {r_lens[row]} response tokens but a loss mask of {len(s.loss_mask)}")
    return np.fromiter(chain.from_iterable(s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
                                           for s in samples), dtype=np.int64, count=int(r_lens.sum())) > 0


def _step_rewards(samples: list[RolloutSample], p_lens: np.ndarray, width: int) -> torch.Tensor | None:
    """`[B, L-1]` per-step rewards of episodes placed by `turn_reward_positions`; None when no sample has one."""
    placed = [turn_reward_positions(s) for s in samples]
    if not any(placed):
        return None
    step_rewards = np.zeros((len(samples), width - 1), dtype=np.float32)
    for row, pairs in enumerate(placed):
        for at, reward in pairs:
            step_rewards[row, p_lens[row] - 1 + at] += reward
    return torch.from_numpy(step_rewards)


def turn_reward_positions(sample: RolloutSample) -> list[tuple[int, float]]:
    """(response index, reward) of each nonzero per-step reward of an episode: step k's reward at the last token of
    generated turn k (the k-th run of loss mask 1). Empty for a single turn, an episode the environment failed
    (`episode["bad"]`: `env.on_bad_tool` scored or dropped it whole) or one whose turns do not match its steps."""
    episode = sample.episode
    if episode is None or episode.get("bad") or not episode.get("turn_rewards") or sample.loss_mask is None:
        return []
    mask = list(sample.loss_mask)
    ends = [j for j in range(len(mask)) if mask[j] and (j + 1 == len(mask) or not mask[j + 1])]
    rewards = episode["turn_rewards"]
    if len(ends) < len(rewards):
        return []
    return [(at, float(r)) for at, r in zip(ends, rewards) if r != 0]


def shaped_token_rewards(traj: Trajectory, rl: RLConfig, kl_coef: float) -> torch.Tensor:
    """Sequence score on the last response token, minus the per-token KL penalty when KL is in the reward. An
    episode's per-step rewards (`step_rewards`) sit at their turns' last tokens and the rest of its score on the
    last token, so a row's token rewards still sum to its score (sequence-level estimators see no difference;
    per-token ones, e.g. REINFORCE++'s reward-to-go, credit each step's reward to the turns up to it only)."""
    kl = None
    if rl.kl_in == "reward" and kl_coef > 0 and traj.ref_logp is not None:
        kl = kl_penalty(traj.behaviour_logp(), traj.ref_logp, rl.kl_estimator)
    if traj.step_rewards is None:
        return token_rewards_from_scores(traj.scores, traj.action_mask, kl=kl, kl_coef=kl_coef)
    steps = traj.step_rewards * traj.action_mask
    rest = traj.scores.to(steps.dtype) - steps.sum(1)
    return token_rewards_from_scores(rest, traj.action_mask, kl=kl, kl_coef=kl_coef) + steps


def with_advantages(traj: Trajectory, rl: RLConfig, kl_coef: float) -> Trajectory:
    """A new Trajectory with token rewards, advantages (and returns, for estimators with a critic), computed by
    the estimator registered as `rl.algo` from exactly the inputs it declares."""
    mask = traj.action_mask
    names = estimator_inputs(rl.algo)  # unknown algo: ValueError naming the registered ones
    if "values" in names and traj.values is None:
        raise ValueError(f"rl.algo={rl.algo} needs critic values (the critic pass did not run)")
    token_rewards = shaped_token_rewards(traj, rl, kl_coef)
    # KL-in-reward for sequence-level estimators: the summed token penalty is folded into the sequence score.
    # A row without action tokens (masked by `rl.overlong_mask`) keeps its score: it still counts in its group's
    # baseline, only its own loss weight is zero.
    scores = torch.where(mask.bool().any(1), (token_rewards * mask).sum(1), traj.scores.to(token_rewards.dtype))
    available = {"rewards": token_rewards, "token_rewards": token_rewards, "scores": scores,
                 "values": traj.values, "mask": mask, "gamma": rl.gamma, "lam": rl.lam,
                 # group_ids, not a fixed group size: groups may have lost samples to the `drop` policy.
                 "group_ids": traj.group_ids, "scale_rewards": rl.scale_rewards}
    advantages, returns = compute_advantages(rl.algo, **{k: available[k] for k in names if k in available})
    return traj.replace(token_rewards=token_rewards, advantages=advantages, returns=returns)


def take_groups(picks: list[tuple[ScoredBatch, int]], metrics: dict) -> ScoredBatch:
    """One ScoredBatch of chosen prompt groups, each `(scored batch, prompt index in it)` (dynamic sampling joins
    groups of several generation rounds of one step, all with the same weights). Prompts are renumbered
    0, 1, ... in `picks` order; a group brings its kept samples, their scores, texts and reward components.
    `metrics` are the joined batch's metrics (the caller's: they describe every round, not only these groups)."""
    rows, samples, scores, raw, texts = [], [], [], [], []
    names = list(dict.fromkeys(name for scored, _ in picks for name in scored.components))
    components: dict[str, list] = {name: [] for name in names}
    by_prompt: dict[int, dict[int, list[int]]] = {}
    for new, (scored, prompt) in enumerate(picks):
        index = by_prompt.get(id(scored))
        if index is None:
            index = by_prompt[id(scored)] = {}
            for i, s in enumerate(scored.samples):
                index.setdefault(s.prompt_index, []).append(i)
        rows.append(scored.rollout.rows[prompt])
        values = scored.raw()
        for i in index.get(prompt, []):
            samples.append(dataclasses.replace(scored.samples[i], prompt_index=new))
            scores.append(scored.scores[i])
            raw.append(values[i])
            texts.append(scored.texts[i] if i < len(scored.texts) else "")
            for name in names:
                column = scored.components.get(name)
                components[name].append(column[i] if column is not None else None)
    version = picks[0][0].rollout.weights_version if picks else 0
    return ScoredBatch(rollout=RolloutBatch(rows=rows, samples=samples, weights_version=version), samples=samples,
                       scores=scores, metrics=dict(metrics), texts=texts, components=components, raw_scores=raw)
