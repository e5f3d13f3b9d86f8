"""The optimisation half of an RL step: PPO epochs over mini-batches of token-budget micro-batches.

Each micro-batch's loss is aggregated within the micro-batch and then weighted by its share of the mini-batch
(response tokens for token-mean; for the seq-mean modes, rows with at least one response token, the rows
`aggregate` averages over), so accumulating any number of micro-batches gives exactly the mini-batch's loss and
gradient, also where a row has no response token (`rl.overlong_mask`). DeepSpeed runs in unmanaged
gradient-accumulation mode: `backward(scale_wrt_gas=False)` per micro-batch, `step()` once per mini-batch.
Non-finite rewards, losses and gradient norms are checked on the way (`recipes/nonfinite.py`).

With `data.rl_packing` each micro-batch runs as one padding-free packed row (`recipes/packed_batch.py`): the token
budget counts real tokens, and the packed outputs are gathered back to the `[B, L-1]` layout before any loss, so
the loss maths are the same as for padded rows. With the shared-prompt layout (`shared_prompt`) the log-prob passes
forward each group's prompt once and its samples' responses after it (`recipes/shared_prompt_batch.py`,
`engines/shared_prompt.py`), in micro-batches of whole groups, their outputs gathered back to the same layout;
with several mini-batches per batch they are shuffled by whole groups (`mini_batch_rows`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ds_rlhf.algos.distill import generalized_jsd
from ds_rlhf.algos.losses import aggregate, entropy_bonus, kl_loss, value_loss
from ds_rlhf.algos.registry import MISMATCH_MODES, POLICY_LOSSES
from ds_rlhf.algos.truncation import truncated_logprobs_from_logits, truncates
from ds_rlhf.config import Config
from ds_rlhf.distributed import agree_max
from ds_rlhf.engines.policy_forward import response_logits, sequence_logprobs
from ds_rlhf.engines.shared_prompt import shared_prompt_logprobs
from ds_rlhf.recipes.batching import split_micro
from ds_rlhf.recipes.nonfinite import check_grad_norm, check_inputs, check_losses, finite_or_zero
from ds_rlhf.recipes.packed_batch import pack_rows
from ds_rlhf.recipes.shared_prompt_batch import group_micro_batches, group_mini_batches, group_order, share_prompts
from ds_rlhf.recipes.trajectory import Trajectory


class _Mean:
    """Weighted running means of scalar metrics."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: dict, weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v) * weight
            self.weights[k] += weight

    def result(self) -> dict[str, float]:
        """Every metric seen, 0.0 for those seen only with weight 0 (a rank whose every token is masked, e.g. by
        `rl.overlong_mask`, still reports the same keys: the ranks average them in one collective)."""
        return {k: self.sums[k] / self.weights[k] if self.weights[k] > 0 else 0.0 for k in self.sums}


@dataclass(frozen=True)
class UpdateResult:
    metrics: dict[str, float]
    trainer_logp: torch.Tensor  # [B, L-1] the pre-update policy's log-probs (for the mismatch metrics)


def micro_batches(traj: Trajectory, rows: list[int], *, max_tokens: int, max_rows: int,
                  packed: bool = False, shared: bool = False) -> list[list[int]]:
    """Split trajectory rows `rows` into micro-batches (lists of row indices; possibly empty, see split_micro: the
    caller then runs its first row with zero weight to keep the collectives in step). The token budget costs a
    padded micro-batch as rows x longest, a `packed` one as its real tokens; `shared` (the shared-prompt layout)
    keeps each group's rows in one micro-batch (`shared_prompt_batch.group_micro_batches`)."""
    if shared:
        return group_micro_batches(traj.prompt_lens.tolist(), traj.response_lens.tolist(), traj.group_ids.tolist(),
                                   rows, max_tokens=max_tokens, max_rows=max_rows, device=traj.input_ids.device)
    groups = split_micro(traj.seq_lens[rows].tolist(), max_tokens=max_tokens, max_rows=max_rows,
                         padded=not packed, device=traj.input_ids.device)
    return [[rows[i] for i in group] for group in groups]


def rl_packing(cfg: Config) -> bool:
    """`data.rl_packing`, with the schema's rule for it (`DataConfig.check`: packing needs a token budget)
    re-checked, for configs built without `parse_config`."""
    cfg.data.check()
    return cfg.data.rl_packing


SHARED_PROMPT_MIN_SAVING = 0.05  # `auto`: the least share of forward tokens the shared-prompt layout must save


def shared_prompt(cfg: Config) -> bool:
    """Whether the log-prob passes use the shared-prompt layout (`data.rl_shared_prompt`). `auto`, from settings
    only so every rank takes the same path (ZeRO-3 gathers weights in every forward): on when each prompt has several
    samples, micro-batches are not packed, and the prompt tokens forwarded once instead of `rollout.n_samples` times
    save at least `SHARED_PROMPT_MIN_SAVING` of the tokens of full-length rows (`data.max_prompt_len`,
    `rollout.max_new_tokens`). The RL build resolves `auto` once for the run, off where the model cannot
    (`rl_build.resolve_shared_prompt`)."""
    setting = cfg.data.rl_shared_prompt
    if setting != "auto":
        return setting == "on"
    n, prompt, response = cfg.rollout.n_samples, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    if n <= 1 or cfg.data.rl_packing:
        return False
    return (n - 1) / n * prompt / (prompt + response) >= SHARED_PROMPT_MIN_SAVING


def micro_logprobs(model, mb: Trajectory, cfg: Config, *, with_entropy: bool = False):
    """Log-probs (and entropy, or None) of micro-batch `mb` under `model`, both `[b, w-1]`: its padded rows with
    their attention mask, with `data.rl_packing` one packed row gathered back to that layout, or the shared-prompt
    layout (`shared_prompt`) gathered back likewise. Positions outside
    `mb.action_mask` read 0 (every consumer masks them). Under top-p / top-k rollouts they are of the sampler's
    truncated, renormalised distribution (`ds_rlhf.algos.truncation`), for the policy, old policy and reference."""
    temperature = cfg.rollout.temperature
    truncation = {"top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k}  # the rollout sampler's kept set
    scored = mb.action_mask > 0  # the losses read the response positions only: the head scores just those
    if shared_prompt(cfg):
        layout = share_prompts(mb.input_ids, mb.prompt_lens, mb.response_lens, mb.group_ids)
        logp, entropy = shared_prompt_logprobs(model, layout.inputs(scored), temperature=temperature,
                                               with_entropy=with_entropy, **truncation)
        return layout.unpack(logp), (layout.unpack(entropy) if entropy is not None else None)
    if not cfg.data.rl_packing:
        return sequence_logprobs(model, mb.input_ids, mb.attention_mask, temperature=temperature,
                                 with_entropy=with_entropy, score_mask=scored, **truncation)
    packed = pack_rows(mb.input_ids, mb.attention_mask)
    logp, entropy = sequence_logprobs(model, packed.input_ids, None, position_ids=packed.position_ids,
                                      temperature=temperature, with_entropy=with_entropy,
                                      score_mask=packed.packed_mask(scored), **truncation)
    return packed.unpack(logp), (packed.unpack(entropy) if entropy is not None else None)


def micro_response_logits(model, mb: Trajectory, cfg: Config):
    """Full-vocabulary logits `[N, V]` of micro-batch `mb` under `model` at its `N` response positions, and a
    function that maps per-row values `[N]` back to the `[b, w-1]` layout (0 elsewhere, differentiable); padded or
    packed like `micro_logprobs`, the rows in the same order for any model."""
    scored = mb.action_mask > 0
    if not cfg.data.rl_packing:
        logits = response_logits(model, mb.input_ids, None, scored, attention_mask=mb.attention_mask)
        mask, targets, unpack = scored, mb.input_ids[:, 1:], (lambda x: x)
    else:
        packed = pack_rows(mb.input_ids, mb.attention_mask)
        mask = packed.packed_mask(scored)
        logits = response_logits(model, packed.input_ids, packed.position_ids, mask)
        targets, unpack = packed.input_ids[:, 1:], packed.unpack

    def to_rows(values: torch.Tensor) -> torch.Tensor:
        return unpack(values.new_zeros(mask.shape).masked_scatter(mask, values))

    return logits, targets[mask], to_rows


def _logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float = 1.0,
                          top_k: int = -1):
    """Per-row log-prob of `targets` and entropy (fp32) of logits `[N, V]` at `temperature` (truncated like the
    rollout's sampler under top-p / top-k)."""
    if truncates(top_p, top_k):
        return truncated_logprobs_from_logits(logits, targets, temperature, top_p, top_k)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def micro_values(critic, mb: Trajectory, cfg: Config) -> torch.Tensor:
    """The critic's values `[b, w-1]` of micro-batch `mb` (position t: the state before token t+1), padded or
    packed like `micro_logprobs`."""
    if not cfg.data.rl_packing:
        return critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)[:, :-1]
    packed = pack_rows(mb.input_ids, mb.attention_mask)
    return packed.unpack(critic(input_ids=packed.input_ids, position_ids=packed.position_ids)[:, :-1])


NONFINITE_KEY = "guard/nonfinite"  # in a micro-step's metrics: its loss was not finite (not back-propagated)
DR_GRPO_AGG = "seq-mean-token-sum-norm"  # the canonical name the config stores for it and its aliases


def _agg_mode(cfg: Config) -> tuple[str, float | None]:
    if cfg.rl.loss_agg == DR_GRPO_AGG:  # Dr.GRPO: divide by a constant, the generation budget
        return DR_GRPO_AGG, float(cfg.rollout.max_new_tokens)
    return cfg.rl.loss_agg, None


def scored_rows(action_mask: torch.Tensor) -> int:
    """Rows with at least one response token: the rows the seq-mean aggregations average over."""
    return int((action_mask.sum(dim=-1) > 0).sum())


def _share(mb: Trajectory, mode: str, total_tokens: float, total_seqs: int) -> float:
    """Micro-batch `mb`'s weight in its mini-batch under aggregation `mode`: its share of the mini-batch's
    `total_tokens` response tokens for token-mean, else its share of the `total_seqs` rows that have one
    (`scored_rows`); the weights of a mini-batch's micro-batches sum to 1 (0 when it has no response token)."""
    if mode == "token-mean":
        return float(mb.action_mask.sum()) / max(total_tokens, 1.0)
    return scored_rows(mb.action_mask) / max(total_seqs, 1)


def actor_micro_step(actor, mb: Trajectory, cfg: Config, kl_coef: float, share: float, *, teacher=None,
                     token_share: float | None = None):
    """Forward, loss and backward for one micro-batch; returns (metrics, detached log-probs).

    With a `teacher` (`rl.distill_loss jsd`) the student's log-probs and entropy come from its full-vocabulary logits
    at the response positions (one forward), and `rl.distill_coef` x the token-mean generalized JSD to the teacher's
    logits (no gradient) is added, weighted by the micro-batch's share of the mini-batch's response tokens
    (`token_share`, default `share`)."""
    mode, const = _agg_mode(cfg)
    rl = cfg.rl
    mask = mb.action_mask
    jsd = None
    if teacher is None:
        logp, entropy = micro_logprobs(actor, mb, cfg, with_entropy=True)
    else:
        temperature = cfg.rollout.temperature
        student, targets, to_rows = micro_response_logits(actor, mb, cfg)
        with torch.no_grad():
            teacher_logits, _, _ = micro_response_logits(teacher, mb, cfg)
        jsd = generalized_jsd(student, teacher_logits, beta=rl.jsd_beta, temperature=temperature)
        del teacher_logits
        logp_rows, entropy_rows = _logprobs_from_logits(student, targets, temperature, cfg.rollout.top_p,
                                                        cfg.rollout.top_k)
        logp, entropy = to_rows(logp_rows), to_rows(entropy_rows)
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    is_weights = MISMATCH_MODES.get(rl.mismatch).fn(old, mb.rollout_logp, mask, rl.tis_cap)
    entry = POLICY_LOSSES.get(rl.policy_loss)
    options = {arg: getattr(rl, key) for arg, key in entry.meta.get("options", {}).items()}  # e.g. SAPO's tau
    loss, metrics = entry.fn(
        logp, old, mb.advantages, mask, clip_low=rl.clip_low, clip_high=rl.clip_high,
        dual_clip=rl.dual_clip or None, agg=mode, const_norm=const, is_weights=is_weights, **options)
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    if rl.kl_in == "loss" and kl_coef > 0:
        kl, _ = kl_loss(logp, mb.ref_logp, mask, rl.kl_estimator, agg=mode, const_norm=const)
        loss = loss + kl_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    if rl.entropy_coef > 0:
        loss = loss - rl.entropy_coef * entropy_bonus(entropy, mask, mode, const)
    metrics["actor/entropy"] = aggregate(entropy, mask, "token-mean").detach()
    metrics["actor/loss"] = loss.detach()
    loss = loss * share
    if jsd is not None:
        loss = loss + rl.distill_coef * jsd * (share if token_share is None else token_share)
        metrics["distill/jsd"] = jsd.detach()
    loss, finite = finite_or_zero(loss, logp)  # a non-finite loss is never back-propagated
    if not finite:
        metrics[NONFINITE_KEY] = 1.0
    actor.backward(loss, scale_wrt_gas=False)
    return metrics, logp.detach()


def critic_agg(cfg: Config) -> str:
    """The value loss's aggregation: the actor's, but token-mean where the actor's is Dr.GRPO's constant norm."""
    mode, _ = _agg_mode(cfg)
    return mode if mode != DR_GRPO_AGG else "token-mean"


def critic_micro_step(critic, mb: Trajectory, cfg: Config, share: float) -> dict:
    """Forward, value loss (`critic_agg`) and backward for one micro-batch; `share`: its weight under that
    aggregation."""
    values = micro_values(critic, mb, cfg)
    loss, metrics = value_loss(values, mb.values, mb.returns, mb.action_mask,
                               clip=cfg.critic.value_clip or None, agg=critic_agg(cfg))
    out = {f"critic/{k}": v for k, v in {**metrics, "loss": loss.detach()}.items()}
    scaled, finite = finite_or_zero(loss * share, values)
    if not finite:
        out[NONFINITE_KEY] = 1.0
    critic.backward(scaled, scale_wrt_gas=False)
    return out


def _mini_batch(actor, critic, exp: Trajectory, rows: list[int], cfg: Config, *, kl_coef: float, teacher,
                stats: _Mean, record: torch.Tensor | None) -> None:
    """One optimizer step over trajectory rows `rows`: their micro-batches' backward passes, each weighted by its
    share (`_share`), then the steps. A micro-batch with a non-finite loss adds no gradient (`rl.on_nonfinite`:
    under fail the ranks stop before the step, under skip it is left out and counted)."""
    mode, _ = _agg_mode(cfg)
    total_tokens = float(exp.action_mask[rows].sum())
    total_seqs = scored_rows(exp.action_mask[rows])
    found = []  # this rank's micro-batches with a non-finite loss, described
    for micro in micro_batches(exp, rows, max_tokens=cfg.data.micro_batch_tokens,
                               max_rows=cfg.optim.micro_batch_size, packed=rl_packing(cfg),
                               shared=shared_prompt(cfg) and teacher is None):
        real = bool(micro)  # an empty micro-batch: run a row with zero weight
        micro = micro or [0]
        mb = exp.select(micro)
        share = _share(mb, mode, total_tokens, total_seqs) if real else 0.0
        token_share = _share(mb, "token-mean", total_tokens, total_seqs) if real else 0.0
        metrics, logp = actor_micro_step(actor, mb, cfg, kl_coef, share, teacher=teacher, token_share=token_share)
        _keep(stats, metrics, share, "actor", micro, found)
        if record is not None and share > 0:
            record[torch.as_tensor(micro, device=record.device), : logp.shape[1]] = logp * mb.action_mask
        if critic is not None:
            value_share = _share(mb, critic_agg(cfg), total_tokens, total_seqs) if real else 0.0
            _keep(stats, critic_micro_step(critic, mb, cfg, value_share), value_share, "critic", micro, found)
    left_out = check_losses(found, cfg.rl.on_nonfinite, exp.input_ids.device)
    stats.add({"guard/nonfinite_micro_batches": float(left_out)}, 1.0)
    actor.step()
    if critic is not None:
        critic.step()
    for name, engine in (("actor", actor), ("critic", critic)):
        norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
        check_grad_norm(engine, norm, name)
        if norm is not None and name == "actor":  # DeepSpeed's norm of the step's gradient, before clipping
            stats.add({"actor/grad_norm": float(norm)}, 1.0)


def _keep(stats: _Mean, metrics: dict, weight: float, role: str, micro: list[int], found: list[str]) -> None:
    """A micro-step's metrics into the step's means; for a loss that was not finite (`NONFINITE_KEY`), a line
    naming it in `found` instead (its metrics left out)."""
    if metrics.pop(NONFINITE_KEY, None):
        found.append(f"{role} loss {float(metrics[f'{role}/loss'])} in the micro-batch of rows {micro}")
    else:
        stats.add(metrics, weight)


def policy_update(actor, critic, exp: Trajectory, cfg: Config, *, kl_coef: float,
               generator: torch.Generator, teacher=None) -> UpdateResult:
    """Run the configured PPO epochs; returns averaged actor/critic metrics, the optimizer-step count and the
    pre-update policy's log-probs: `exp.old_logp` when that pass was made, else the log-probs of the single
    update's own forward pass (`RLConfig.single_update`). `teacher` (frozen): the distillation loss's teacher
    (`rl.distill_loss`), or None. Non-finite rewards, advantages, losses or gradient norms raise `NonFinite`
    (`recipes/nonfinite.py`)."""
    if (teacher is not None) != (cfg.rl.distill_loss != "none"):
        raise ValueError(f"rl.distill_loss={cfg.rl.distill_loss} needs a teacher engine exactly when it is not none")
    check_inputs(exp, exp.input_ids.device)
    if teacher is not None:
        teacher.eval()
    n = len(exp)
    record = torch.zeros_like(exp.action_mask) if exp.old_logp is None else None
    mini = cfg.rl.mini_batch_size or n
    stats, steps = _Mean(), 0
    actor.train()
    if critic is not None:
        critic.train()
    for _ in range(cfg.rl.ppo_epochs):
        # Same number of mini-batches on every rank (ranks can hold different sample counts after drops).
        n_mini = agree_max(-(-n // mini), exp.input_ids.device)
        for rows in mini_batch_rows(exp, n_mini, generator, shuffle=cfg.rl.ppo_epochs > 1 or mini < n,
                                    grouped=shared_prompt(cfg) and teacher is None):
            _mini_batch(actor, critic, exp, rows, cfg, kl_coef=kl_coef, teacher=teacher, stats=stats, record=record)
            steps += 1
    out = stats.result()
    out["guard/nonfinite_micro_batches"] = stats.sums["guard/nonfinite_micro_batches"]  # a count, not a mean
    out["actor/optimizer_steps"] = steps
    out["actor/lr"] = actor.get_lr()[0] if hasattr(actor, "get_lr") else cfg.optim.lr
    return UpdateResult(metrics=out, trainer_logp=record if record is not None else exp.old_logp)


def mini_batch_rows(exp: Trajectory, count: int, generator: torch.Generator, *, shuffle: bool,
                    grouped: bool) -> list[list[int]]:
    """One epoch's `count` mini-batches of `exp`'s rows: shuffled row by row (`shuffle`), or with the shared-prompt
    layout (`grouped`) by whole groups, so each group's prompt is forwarded once per mini-batch
    (`shared_prompt_batch.group_mini_batches` says where the cuts fall); in order when not `shuffle`."""
    n = len(exp)
    if shuffle and grouped:
        groups = exp.group_ids.tolist()
        return group_mini_batches(groups, group_order(groups, generator), count)
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    per = -(-n // count)
    return [order[k * per : (k + 1) * per] for k in range(count)]


@torch.no_grad()
def forward_logprobs(model, exp: Trajectory, cfg: Config) -> torch.Tensor:
    """Log-probs of every row under `model` (old policy or reference), micro-batched like training."""
    model.eval()
    out = torch.zeros_like(exp.action_mask)
    rows = list(range(len(exp)))
    for micro in micro_batches(exp, rows, max_tokens=cfg.data.micro_batch_tokens,
                               max_rows=cfg.optim.micro_batch_size, packed=rl_packing(cfg), shared=shared_prompt(cfg)):
        mb = exp.select(micro or [0])
        logp, _ = micro_logprobs(model, mb, cfg)
        if not micro:
            continue
        out[torch.as_tensor(micro, device=out.device), : logp.shape[1]] = logp.to(out.dtype) * mb.action_mask
    return out


@torch.no_grad()
def forward_values(critic, exp: Trajectory, cfg: Config) -> torch.Tensor:
    """The critic's values of every row, micro-batched like training."""
    critic.eval()
    out = torch.zeros_like(exp.action_mask)
    for micro in micro_batches(exp, list(range(len(exp))), max_tokens=cfg.data.micro_batch_tokens,
                               max_rows=cfg.optim.micro_batch_size, packed=rl_packing(cfg)):
        mb = exp.select(micro or [0])
        values = micro_values(critic, mb, cfg)
        if not micro:
            continue
        out[torch.as_tensor(micro, device=out.device), : values.shape[1]] = values.to(out.dtype) * mb.action_mask
    return out
