"""Turn rollout samples into padded training tensors, and cut them into token-budget micro-batches.

Layout: each row is prompt + response, right-padded to the batch's longest row. Per-token tensors have length
L-1 and are indexed by the position that *predicts* the token: position t scores token t+1, so
`action_mask[:, t]` is 1 exactly when token t+1 is a response token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ds_rlhf.data.packing import token_budget_microbatches
from ds_rlhf.distributed import agree_max


@dataclass
class Experience:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    action_mask: torch.Tensor  # [B, L-1] float
    rollout_logp: torch.Tensor  # [B, L-1] float, log-probs the rollout engine sampled with
    scores: torch.Tensor  # [B] float, sequence rewards
    prompt_lens: torch.Tensor  # [B] long
    response_lens: torch.Tensor  # [B] long
    group_ids: torch.Tensor  # [B] long, index of the prompt the sample answers
    # Filled in by the trainer as it goes:
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def old_logp_or_rollout(self) -> torch.Tensor:
        """The behaviour policy's log-probs: the trainer's own when computed, else the rollout engine's."""
        return self.old_logp if self.old_logp is not None else self.rollout_logp

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    def select(self, index: list[int] | torch.Tensor) -> Experience:
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
        return Experience(**out)

    def to(self, device) -> Experience:
        return Experience(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})


def pad_right(seqs: list[list[int]], pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask) for token-id sequences."""
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, x in enumerate(seqs):
        ids[row, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
        attn[row, : len(x)] = 1
    return ids.to(device), attn.to(device)


def build_experience(samples, scores: list[float], pad_id: int, device="cpu") -> Experience:
    """Pad `RolloutSample`s (prompt_ids, response_ids, logprobs, prompt_index) into an Experience."""
    if not samples:
        raise ValueError("no rollout samples to train on")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    action_mask = torch.zeros((batch, width - 1))
    rollout_logp = torch.zeros((batch, width - 1))
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if len(s.logprobs) != r:
            raise ValueError(f"sample {row}: {r} response tokens but {len(s.logprobs)} log-probs")
        input_ids[row, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[row, : p + r] = 1
        action_mask[row, p - 1 : p + r - 1] = 1.0
        rollout_logp[row, p - 1 : p + r - 1] = torch.tensor(s.logprobs, dtype=torch.float32)
    return Experience(
        input_ids=input_ids, attention_mask=attention_mask, action_mask=action_mask, rollout_logp=rollout_logp,
        scores=torch.tensor(scores, dtype=torch.float32),
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lens=torch.tensor([len(s.response_ids) for s in samples]),
        group_ids=torch.tensor([s.prompt_index for s in samples]),
    ).to(device)


def split_micro(lengths: list[int], *, max_tokens: int, max_rows: int, padded: bool = False,
                device=None) -> list[list[int]]:
    """Index groups: by token budget when `max_tokens` > 0, else `max_rows` each; the same count on every rank
    (see `agree_max`), so a rank with less data gets smaller or empty micro-batches rather than fewer."""
    n = len(lengths)
    if max_tokens > 0:
        groups = token_budget_microbatches(lengths, max_tokens, padded=padded) if n else []
    else:
        groups = [list(range(i, min(i + max_rows, n))) for i in range(0, n, max_rows)]
    count = agree_max(len(groups), device or "cpu")
    if count > len(groups):
        if max_tokens > 0 and n:
            groups = token_budget_microbatches(lengths, max_tokens, padded=padded, min_microbatches=count)
        else:
            per = -(-n // count) if n else 0
            groups = [list(range(i * per, min((i + 1) * per, n))) for i in range(count)]
    return groups


def micro_batches(exp: Experience, rows: list[int], *, max_tokens: int, max_rows: int) -> list[list[int]]:
    """Split experience rows `rows` into padded micro-batches (lists of row indices; possibly empty, see
    split_micro: the caller then runs its first row with zero weight to keep the collectives in step)."""
    groups = split_micro(exp.seq_lens[rows].tolist(), max_tokens=max_tokens, max_rows=max_rows, padded=True,
                         device=exp.input_ids.device)
    return [[rows[i] for i in group] for group in groups]
