"""Per-token log-probs (and entropy) of a causal LM without materialising fp32 [B, T, V] logits.

The backbone runs as usual; the output head is swapped, for the duration of one call, for the chunked log-prob
function of `ds_rlhf.algos.logprobs`. Calling it *through the head module* keeps DeepSpeed's ZeRO-3 hooks in
charge of gathering the (possibly tied) head weight for forward and backward, exactly as for a normal Linear.

The whole pass (backbone, head) runs as the forward of the model's root module, called through the model as
given: for a DeepSpeed engine that is `engine(...)`, i.e. `DeepSpeedEngine.forward`, which does DeepSpeed's
per-forward bookkeeping. Under ZeRO-3 that bookkeeping is where the optimizer counts micro-batches
(`clear_backward_seen_flag` advances `micro_step_id` after each backward); a pass that called the submodules
directly would leave the count at 0, and each micro-batch's gradient would then overwrite, not add to, the ones
before it in the same optimizer step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ds_rlhf.algos.logprobs import token_logprobs_from_hidden
from ds_rlhf.engines.models import unwrap


@contextmanager
def _replaced_forward(module: torch.nn.Module, forward):
    """`module(...)` runs `forward` (with all of the module's hooks) until exit; then its own forward again."""
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield module
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward  # back to the class's own forward



def as_root_forward(model, forward, **inputs):
    """`forward(**inputs)` run as the forward of `model`'s root module, called through `model` as given: for a
    DeepSpeed engine that is `DeepSpeedEngine.forward`, where ZeRO-3 counts micro-batches. A model-like view that is
    no module (engines/shared_base.py) runs `forward` on its submodules directly."""
    root = unwrap(model)
    if not isinstance(root, torch.nn.Module):
        return forward(**inputs)
    with _replaced_forward(root, forward):
        return model(**inputs)

@contextmanager
def _logprob_head(head: torch.nn.Module, *, temperature: float, with_entropy: bool, chunk_size: int,
                  truncation: tuple[float, int]):
    top_p, top_k = truncation

    def forward(hidden, targets):
        return token_logprobs_from_hidden(hidden, head.weight, targets, chunk_size=chunk_size,
                                          temperature=temperature, with_entropy=with_entropy,
                                          lm_head_bias=getattr(head, "bias", None), top_p=top_p, top_k=top_k)

    with _replaced_forward(head, forward):
        yield head


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_size: int = 2048, score_mask: torch.Tensor | None = None,
                      top_p: float = 1.0, top_k: int = -1):
    """Log-prob of tokens[:, 1:] given their prefix: ([B, L-1], entropy [B, L-1] or None).

    `top_p` < 1 or `top_k` > 0: log-probs and entropy of the tempered distribution truncated as the rollout's
    sampler truncates it (top-k, then top-p) and renormalised (`ds_rlhf.algos.truncation`).

    Packed padding-free input: one row, `attention_mask=None` and `position_ids` restarting at 0 for each
    sequence; transformers then builds a block-diagonal causal mask, so sequences never attend to each other.

    `score_mask` (bool, `[B, L-1]`): only those positions go through the output head (RL scores the response
    tokens only; the prompt's positions are a third of an RL batch and of the head's ``V``-wide work); the others
    read 0 and get no gradient. Where it selects nothing (a zero-weight micro-batch of masked rows), every position
    still goes through the head, so the head weight gets its (zero) gradient on every rank alike, and all read 0.
    """
    hf = unwrap(model, peft=True)

    def forward(input_ids, attention_mask, position_ids, score_mask):
        return _logprob_pass(hf, input_ids, attention_mask, position_ids, score_mask, temperature=temperature,
                             with_entropy=with_entropy, chunk_size=chunk_size, truncation=(top_p, top_k))

    return as_root_forward(model, forward, input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, score_mask=score_mask)


def response_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, score_mask: torch.Tensor, *,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The output head's full-vocabulary logits `[N, V]` at the `N` positions set in `score_mask` (bool, `[B, L-1]`;
    position t holds the logits that predict token t+1), in row-major order of `score_mask`.

    Run like `sequence_logprobs`: the whole pass is the forward of the model's root module called through the model
    as given (a DeepSpeed engine's forward), the head called as a module (ZeRO-3 gathers its weight). Only the
    selected positions go through the head, so the memory is `N x V` logits, not `B x L x V`. Where `score_mask`
    selects nothing every position still goes through the head (its weight gets a zero gradient on every rank
    alike) and the result has 0 rows."""
    hf = unwrap(model, peft=True)

    def forward(input_ids, attention_mask, position_ids, score_mask):
        return _logits_pass(hf, input_ids, attention_mask, position_ids, score_mask)

    return as_root_forward(model, forward, input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, score_mask=score_mask)


def _logits_pass(hf, input_ids, attention_mask, position_ids, score_mask) -> torch.Tensor:
    """The backbone and the head of `response_logits` (run as the root module's forward)."""
    hidden = hf.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    if score_mask.shape != input_ids[:, 1:].shape:
        raise ValueError(f"score_mask shape {tuple(score_mask.shape)} != scored positions "
                         f"{tuple(input_ids[:, 1:].shape)}")
    rows = score_mask.reshape(-1).nonzero().squeeze(1)
    head = hf.get_output_embeddings()
    if rows.numel() == 0:
        return head(hidden)[:0]
    return head(hidden.index_select(0, rows))


def _logprob_pass(hf, input_ids, attention_mask, position_ids, score_mask, *, temperature: float,
                  with_entropy: bool, chunk_size: int, truncation: tuple[float, int] = (1.0, -1)):
    """The backbone and the chunked head of `sequence_logprobs` (run as the root module's forward)."""
    hidden = hf.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
    return head_logprobs(hf.get_output_embeddings(), hidden[:, :-1], input_ids[:, 1:], score_mask,
                         temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
                         truncation=truncation)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, score_mask: torch.Tensor | None,
                  *, temperature: float, with_entropy: bool, chunk_size: int,
                  truncation: tuple[float, int] = (1.0, -1)):
    """The chunked head over `hidden` `[B, T, D]`: the log-prob (and entropy, or None) of `targets` `[B, T]`, each
    `[B, T]`. With `score_mask` (bool `[B, T]`) only those positions go through the head and the others read 0;
    where it selects nothing every position goes through the head and all read 0 (a zero gradient for the head's
    weight on every rank alike)."""
    shape = targets.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    rows, nothing = None, False
    if score_mask is not None:
        if score_mask.shape != shape:
            raise ValueError(f"score_mask shape {tuple(score_mask.shape)} != scored positions {tuple(shape)}")
        rows = score_mask.reshape(-1).nonzero().squeeze(1)
        nothing = rows.numel() == 0
        if nothing:
            rows = None
        else:
            hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    with _logprob_head(head, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
                       truncation=truncation) as h:
        logp, entropy = h(hidden, targets)
    if nothing:  # still in the graph (zero gradients), nothing unmasked leaks out
        logp, entropy = logp * 0, (entropy * 0 if entropy is not None else None)
    if rows is not None:
        logp = _scatter(logp, rows, shape.numel())
        entropy = _scatter(entropy, rows, shape.numel()) if entropy is not None else None
    return logp.view(shape), (entropy.view(shape) if entropy is not None else None)


def _scatter(values: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
    """`values` at flat positions `rows` of a zero vector of `size` (differentiable in `values`)."""
    return values.new_zeros(size).index_copy(0, rows, values)
