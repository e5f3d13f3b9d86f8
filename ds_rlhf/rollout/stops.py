"""The token ids that end a response: the tokenizer's EOS, the model's generation-config EOS ids, and the chat
template's end-of-turn token.

Chat models disagree on which one closes an assistant turn: ChatML models (SmolLM2-Instruct, Qwen2.5-Instruct)
write `<|im_end|>`, Llama-3-Instruct `<|eot_id|>`, Gemma `<end_of_turn>`; a model directory's
`generation_config.json` may list several EOS ids (Llama-3.1-Instruct: [128001, 128008, 128009]); and the
tokenizer's `eos_token` is sometimes none of them. Rollouts and evaluation stop at every id `stop_token_ids`
returns, so a response ends where the model ends its turn whichever convention it follows.

The end-of-turn token is found by rendering a one-turn conversation with the tokenizer's chat template and taking
the first special (or added) token after the assistant's content (`engines/chat_tokens.py:end_of_turn_id`); a
tokenizer without a template has none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.errors import ConfigError

GENERATION_CONFIG = "generation_config.json"


def stop_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Every id that ends a response, deduplicated, in this order: the tokenizer's EOS, the generation config's
    `eos_token_id` (an int or a list), the chat template's end-of-turn token.

    `generation_config`: a model directory (its `generation_config.json`; without one, the EOS of its
    `config.json`, as transformers and vLLM fall back to), a `transformers.GenerationConfig`, a dict, or None."""
    ids = [tokenizer.eos_token_id, *generation_eos_ids(generation_config), end_of_turn_id(tokenizer)]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def run_stop_token_ids(ctx) -> tuple[int, ...]:
    """A run's stop ids: `stop_token_ids` of its `ctx.tokenizer` and model directory `ctx.model_path`, computed
    on the first call and kept on `ctx` (rollouts of every step and evaluation use the same tuple)."""
    stops = getattr(ctx, "_stop_token_ids", None)
    if stops is None:
        stops = stop_token_ids(ctx.tokenizer, getattr(ctx, "model_path", None))
        ctx._stop_token_ids = stops
    return stops


def generation_eos_ids(source) -> list[int]:
    """The `eos_token_id` ids of a generation config (see `stop_token_ids` for what `source` may be)."""
    if source is None:
        return []
    if isinstance(source, Mapping):
        return _eos_list(source.get("eos_token_id"), "the generation config")
    if not isinstance(source, (str, Path)):  # a GenerationConfig (or a model config) object
        return _eos_list(getattr(source, "eos_token_id", None), f"{type(source).__name__}.eos_token_id")
    model_dir = Path(source)
    if not model_dir.is_dir():
        raise ConfigError(f"model path {str(source)!r} is not a directory: the stop tokens come from its "
                          f"{GENERATION_CONFIG} / config.json")
    from transformers import AutoConfig, GenerationConfig

    own = (model_dir / GENERATION_CONFIG).is_file()
    where = model_dir / (GENERATION_CONFIG if own else "config.json")
    try:
        if own:
            config = GenerationConfig.from_pretrained(str(model_dir))
        else:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(model_dir)))
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"{where} cannot be read for its eos_token_id ({type(exc).__name__}: {first}): fix the "
                          "file") from None
    return _eos_list(config.eos_token_id, str(where))


def _eos_list(value, where: str) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes)) \
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of token ids, got {value!r}")
    return [int(v) for v in values]
