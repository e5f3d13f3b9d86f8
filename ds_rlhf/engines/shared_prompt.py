"""Per-token log-probs of samples that share their prompt, with each prompt forwarded once (`data.rl_shared_prompt`).

Two passes of the backbone, both inside one forward of the model's root module (as `policy_forward`: a DeepSpeed
engine's forward, where ZeRO-3 counts micro-batches):

1. the prompt pass: the micro-batch's distinct prompts `[G, P]`, right-padded, positions 0 .. p-1; each layer's
   keys and values are kept (`_PrefixLayer`, recording);
2. the response pass: every sample's response `[B, R]`, right-padded, positions p .. p+r-1 of its own prompt, its
   attention reading its group's prompt keys and values (picked with `group_index`, `[B, P]`) and its own response
   tokens causally. The 2D attention mask is `[prompt mask of its group | response mask]`.

The response token j of a sample is scored by the hidden state before it: for j = 0 the last prompt token's (the
prompt pass, shared by the group), for j > 0 the response pass's position j - 1. Attention over the same keys with
the same rotary positions gives the log-probs of one padded row per sample up to float rounding; gradients flow
into the prompt pass through the shared keys and values and the last prompt token.

Gradient checkpointing: transformers drops a cache passed to a checkpointed layer unless the layer is marked as
safe to replay (`_can_checkpoint_with_cache`); here replaying is safe, so the passes mark the layers for their
duration: the recording layers replace their states on a replay (never append), and the response pass reads a
second cache that no replay writes.

Supported: decoder-only models whose layers are all full attention (`supports_shared_prompt`) with the sdpa,
eager or flash_attention_2 kernel; the varlen kernel of packed rows reads no cache.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ds_rlhf.engines.models import unwrap
from ds_rlhf.engines.policy_forward import as_root_forward, head_logprobs

ATTENTION = ("sdpa", "eager", "flash_attention_2")  # the kernels that read a cache with a 2D padding mask


class _PrefixLayer(DynamicLayer):
    """One layer's prompt keys and values. Recording (the prompt pass): `update` keeps the given states, replacing
    any earlier ones (a checkpointed layer's replay writes the same values again). Frozen (the response pass): `update`
    returns the prompt's states followed by the given ones and keeps nothing."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.frozen = keys is not None
        if self.frozen:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.frozen:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


def _expanded(prefix: Cache, group_index: torch.Tensor) -> Cache:
    """A frozen cache holding, for each sample, its group's prompt states (row `group_index[i]` of `prefix`)."""
    return Cache(layers=[_PrefixLayer(layer.keys.index_select(0, group_index),
                                      layer.values.index_select(0, group_index)) for layer in prefix.layers])


@contextmanager
def _cache_through_checkpointing(backbone: torch.nn.Module):
    """The backbone's layers keep their cache under gradient checkpointing until exit (the module doc says why)."""
    modules = backbone.modules() if isinstance(backbone, torch.nn.Module) else ()  # a view: engines/shared_base.py
    marked = [m for m in modules if getattr(m, "gradient_checkpointing", False)
              and hasattr(type(m), "_can_checkpoint_with_cache")]
    for m in marked:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in marked:
            del m._can_checkpoint_with_cache


def supports_shared_prompt(model) -> str:
    """Why `model` cannot run the shared-prompt passes, or "" when it can: a decoder whose every layer is full
    attention, on a kernel that reads a cache with a padding mask (`ATTENTION`)."""
    hf = unwrap(model, peft=True)
    config = getattr(hf, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(hf, "get_decoder"):
        return "not a decoder-only transformers model"
    kernel = getattr(config, "_attn_implementation", None) or "eager"
    if kernel not in ATTENTION:
        return f"attention kernel {kernel!r} reads no KV cache (one of {', '.join(ATTENTION)} does)"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return f"sliding-window or other layers than full attention (layer types {', '.join(sorted(kinds))})"
    return ""


def shared_prompt_logprobs(model, rows: dict[str, torch.Tensor], *, temperature: float = 1.0,
                           with_entropy: bool = False, chunk_size: int = 2048, top_p: float = 1.0, top_k: int = -1):
    """Log-probs (and entropy, or None) `[B, R]` of each sample's response tokens: position j scores response token
    j (`rows["targets"]`), only where `rows["score_mask"]` is set (the others read 0, see `head_logprobs`).

    `rows` (from `recipes/shared_prompt_batch.py:SharedPromptRows.inputs`): `prompt_ids`, `prompt_mask` `[G, P]`
    (right-padded), `prompt_lens` `[G]`, `response_ids`, `response_mask`, `response_positions`, `targets`,
    `score_mask` `[B, R]`, `group_index` `[B]` (the sample's prompt row)."""
    hf = unwrap(model, peft=True)

    def forward(**inputs):
        return _shared_pass(hf, inputs, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
                            truncation=(top_p, top_k))

    return as_root_forward(model, forward, **rows)


def _shared_pass(hf, rows: dict[str, torch.Tensor], *, temperature: float, with_entropy: bool, chunk_size: int,
                 truncation: tuple[float, int]):
    """The two backbone passes and the chunked head of `shared_prompt_logprobs` (run as the root module's forward)."""
    backbone = hf.get_decoder()
    prompts, group_index = rows["prompt_ids"], rows["group_index"]
    positions = torch.arange(prompts.shape[1], device=prompts.device).expand_as(prompts)
    prefix = Cache(layer_class_to_replicate=_PrefixLayer)
    with _cache_through_checkpointing(backbone):
        prompt_hidden = backbone(input_ids=prompts, attention_mask=rows["prompt_mask"], position_ids=positions,
                                 past_key_values=prefix, use_cache=False).last_hidden_state
        mask = torch.cat([rows["prompt_mask"].index_select(0, group_index), rows["response_mask"]], dim=1)
        response_hidden = backbone(input_ids=rows["response_ids"], attention_mask=mask,
                                   position_ids=rows["response_positions"],
                                   past_key_values=_expanded(prefix, group_index), use_cache=False).last_hidden_state
    last = prompt_hidden[torch.arange(prompts.shape[0], device=prompts.device), rows["prompt_lens"] - 1]
    hidden = torch.cat([last.index_select(0, group_index)[:, None], response_hidden[:, :-1]], dim=1)
    return head_logprobs(hf.get_output_embeddings(), hidden, rows["targets"], rows["score_mask"],
                         temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size,
                         truncation=truncation)
