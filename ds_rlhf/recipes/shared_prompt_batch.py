"""The shared-prompt layout of an RL micro-batch (`data.rl_shared_prompt`), its way back, and micro-batches of whole
groups.

A micro-batch of right-padded rows `[B, L]` (prompt + response) whose samples answer the same prompt in groups
(GRPO's `rollout.n` samples per prompt) becomes the inputs of `engines/shared_prompt.py`: each distinct prompt once
(`prompt_ids [G, P]`, right-padded) and each sample's response (`response_ids [B, R]`, right-padded, positions
continuing from its prompt's length). Rows share a prompt when they have the same `group_ids` entry, the same
prompt length and the same prompt tokens (checked; a row whose prompt differs gets a prompt row of its own).

Per-position outputs of the layout (`[B, R]`, position j scoring response token j) map to the padded `[B, L-1]`
layout the losses use: response token j of row i is padded position p_i - 1 + j. `SharedPromptRows.unpack` is a
gather (autograd flows back); the prompt positions and the padding read 0, as in `packed_batch.py`.

`group_micro_batches` splits rows into micro-batches that hold whole groups (a group is split only when it alone
exceeds the budget), so each group's prompt is forwarded once per micro-batch. With several mini-batches per batch
(`rl.ppo_epochs` > 1 or `rl.mini_batch_size`), `group_order` shuffles whole groups and `group_mini_batches` cuts
them into mini-batches at group boundaries: the cut falls where the row-wise shuffle's would (every
`ceil(rows / mini-batches)` rows), moved to the nearest group boundary when it would split a group, and left
where it falls when a mini-batch is smaller than a group. The loss weighting within a mini-batch is the row-wise
one (`policy_update._share`), so the update is the padded rows' on the same mini-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_rlhf.distributed import agree_max


@dataclass(frozen=True)
class SharedPromptRows:
    """A micro-batch in the shared-prompt layout, with the index map back to the padded `[B, L-1]` layout."""

    prompt_ids: torch.Tensor  # [G, P] long, right-padded
    prompt_mask: torch.Tensor  # [G, P] long
    prompt_lens: torch.Tensor  # [G] long
    response_ids: torch.Tensor  # [B, R] long, right-padded (R >= 1)
    response_mask: torch.Tensor  # [B, R] long
    response_positions: torch.Tensor  # [B, R] long: p_i .. p_i + R - 1
    group_index: torch.Tensor  # [B] long: the row's prompt in prompt_ids
    gather_index: torch.Tensor  # [B, L-1] long: flat [B * R] position scoring padded (i, t); B * R = reads 0

    @property
    def forward_tokens(self) -> int:
        """Tokens the two passes forward (padding included)."""
        return self.prompt_ids.numel() + self.response_ids.numel()

    def shared_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """bool `[B, R]`: the layout positions that score a padded position set in `mask` (`[B, L-1]`)."""
        if mask.shape != self.gather_index.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != padded positions {tuple(self.gather_index.shape)}")
        out = torch.zeros(self.response_ids.numel() + 1, dtype=torch.bool, device=mask.device)
        out[self.gather_index[mask.bool()]] = True
        return out[:-1].view(self.response_ids.shape)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Layout values `[B, R]` in the padded `[B, L-1]` layout (0 where no response token is scored);
        differentiable: an index into the values plus one appended zero."""
        if values.shape != self.response_ids.shape:
            raise ValueError(f"expected values of shape {tuple(self.response_ids.shape)}, got {tuple(values.shape)}")
        flat = values.reshape(-1)
        return torch.cat([flat, flat.new_zeros(1)])[self.gather_index]

    def inputs(self, score_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors `engines/shared_prompt.py:shared_prompt_logprobs` reads, scoring the padded positions set in
        `score_mask` (`[B, L-1]`)."""
        return {"prompt_ids": self.prompt_ids, "prompt_mask": self.prompt_mask, "prompt_lens": self.prompt_lens,
                "response_ids": self.response_ids, "response_mask": self.response_mask,
                "response_positions": self.response_positions, "targets": self.response_ids,
                "score_mask": self.shared_mask(score_mask), "group_index": self.group_index}


def _prompt_rows(input_ids: torch.Tensor, prompt_lens: torch.Tensor, group_ids: torch.Tensor) -> list[int]:
    """For each row, the first row with its group id and prompt length whose prompt tokens equal its own (itself if
    none)."""
    keys = list(zip(group_ids.tolist(), prompt_lens.tolist()))
    first: dict[tuple[int, int], int] = {}
    owner = [first.setdefault(key, i) for i, key in enumerate(keys)]
    width = int(prompt_lens.max())
    index = torch.as_tensor(owner, device=input_ids.device)
    inside = torch.arange(width, device=input_ids.device)[None, :] < prompt_lens[:, None]
    same = ((input_ids[:, :width] == input_ids[index, :width]) | ~inside).all(1)
    if bool(same.all()):
        return owner
    return [o if ok else i for i, (o, ok) in enumerate(zip(owner, same.tolist()))]


def share_prompts(input_ids: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor,
                  group_ids: torch.Tensor) -> SharedPromptRows:
    """The shared-prompt layout of right-padded rows `input_ids [B, L]` (row i: `prompt_lens[i]` prompt tokens, then
    `response_lens[i]` response tokens); see the module doc."""
    device = input_ids.device
    prompt_lens, response_lens = prompt_lens.to(device), response_lens.to(device)
    owner = _prompt_rows(input_ids, prompt_lens, group_ids)
    heads = sorted(set(owner))
    slot = {row: g for g, row in enumerate(heads)}
    group_index = torch.as_tensor([slot[o] for o in owner], dtype=torch.long, device=device)
    heads_t = torch.as_tensor(heads, dtype=torch.long, device=device)
    p_lens = prompt_lens.index_select(0, heads_t)
    width = int(p_lens.max())
    prompt_mask = (torch.arange(width, device=device)[None, :] < p_lens[:, None]).long()
    prompt_ids = input_ids.index_select(0, heads_t)[:, :width] * prompt_mask
    resp = max(int(response_lens.max()), 1)
    j = torch.arange(resp, device=device)[None, :]
    response_mask = (j < response_lens[:, None]).long()
    cols = (prompt_lens[:, None] + j).clamp(max=input_ids.shape[1] - 1)
    response_ids = input_ids.gather(1, cols) * response_mask
    batch, padded = input_ids.shape[0], input_ids.shape[1] - 1
    t = torch.arange(padded, device=device)[None, :]
    k = t - (prompt_lens[:, None] - 1)  # the response token padded position t scores
    rows = torch.arange(batch, device=device)[:, None]
    gather_index = torch.where((k >= 0) & (k < response_lens[:, None]), rows * resp + k.clamp(0, resp - 1),
                               torch.full_like(k, batch * resp))
    return SharedPromptRows(prompt_ids=prompt_ids, prompt_mask=prompt_mask, prompt_lens=p_lens,
                            response_ids=response_ids, response_mask=response_mask,
                            response_positions=prompt_lens[:, None] + j, group_index=group_index,
                            gather_index=gather_index)


def _cost(rows: list[int], p_lens: list[int], r_lens: list[int], groups: list[int]) -> int:
    """Tokens of `rows` as a micro-batch: the larger of the shared-prompt layout's (distinct prompts x longest prompt +
    rows x longest response) and the padded rows' (rows x longest row), so the budget holds for either layout."""
    if not rows:
        return 0
    shared = len({groups[i] for i in rows}) * max(p_lens[i] for i in rows) + len(rows) * max(r_lens[i] for i in rows)
    return max(shared, len(rows) * max(p_lens[i] + r_lens[i] for i in rows))


def group_micro_batches(prompt_lens: list[int], response_lens: list[int], group_ids: list[int], rows: list[int], *,
                        max_tokens: int, max_rows: int, device=None) -> list[list[int]]:
    """Split `rows` into micro-batches of whole groups: by token budget (`_cost` <= `max_tokens`) when `max_tokens`
    > 0, else at most `max_rows` rows each; a group over the limit alone is cut into pieces. Groups go longest row
    first. The same count on every rank (`agree_max`): a rank with fewer splits its largest micro-batches, or adds
    empty ones when every micro-batch is one row (the caller runs an empty one's first row with zero weight)."""
    units: dict[int, list[int]] = {}
    for i in rows:
        units.setdefault(group_ids[i], []).append(i)
    order = sorted(units.values(), key=lambda u: -max(prompt_lens[i] + response_lens[i] for i in u))

    def fits(candidate: list[int]) -> bool:
        if max_tokens > 0:
            return _cost(candidate, prompt_lens, response_lens, group_ids) <= max_tokens
        return len(candidate) <= max_rows

    bins: list[list[int]] = []
    cur: list[int] = []
    for unit in order:
        if cur and not fits(cur + unit):
            bins.append(cur)
            cur = []
        for i in unit:  # a group over the limit alone: pieces that fit (at least one row each)
            if cur and not fits(cur + [i]):
                bins.append(cur)
                cur = []
            cur.append(i)
    if cur:
        bins.append(cur)
    count = agree_max(len(bins), device or "cpu")
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda b: len(bins[b])) if bins else None
        if largest is None or len(bins[largest]) < 2:
            bins.append([])
            continue
        rows_of = bins.pop(largest)
        half = len(rows_of) // 2
        bins[largest:largest] = [rows_of[:half], rows_of[half:]]
    return bins


def group_order(group_ids: list[int], generator: torch.Generator) -> list[int]:
    """The rows in a random order of whole groups: the groups (in order of first appearance) permuted by
    `generator`, each group's rows together in their own order."""
    units: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        units.setdefault(g, []).append(i)
    groups = list(units.values())
    return [i for k in torch.randperm(len(groups), generator=generator).tolist() for i in groups[k]]


def group_mini_batches(group_ids: list[int], order: list[int], count: int) -> list[list[int]]:
    """`order` (whole groups together, `group_order`) cut into `count` mini-batches of about `ceil(n / count)` rows,
    each cut moved to the nearest group boundary (a tie: after the group) so no group is split; where that size is
    under the largest group's row count every cut stays where it falls (the groups stay contiguous, each spans the
    fewest mini-batches). Mini-batches past the rows are empty, as the row-wise cut's are."""
    n = len(order)
    per = -(-n // count) if count else n
    starts = [k for k in range(n) if k == 0 or group_ids[order[k]] != group_ids[order[k - 1]]] + [n]
    largest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    cuts, prev = [], 0
    for k in range(1, count):
        target = min(k * per, n)
        if per >= largest and target not in starts:
            after = next(s for s in starts if s > target)
            before = max(s for s in starts if s < target)
            target = after if after - target <= target - before else before
        prev = max(prev, target)
        cuts.append(prev)
    bounds = [0, *cuts, n]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]
