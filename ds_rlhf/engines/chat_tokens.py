"""The special tokens of a tokenizer's chat template, found by rendering a probe conversation with it.

- `end_of_turn_id` / `end_of_turn_token`: the token that closes an assistant turn (`<|im_end|>` for ChatML,
  `<|eot_id|>` for Llama 3, `<end_of_turn>` for Gemma): the first special (or added) token after the assistant's
  content. Rollouts stop at it (`rollout/stops.py`), GGUF conversion makes it the EOS (`gguf_import.py`), and a
  reward model reads its score there (`rm_scoring.py`).
- `turn_tail_ids`: what the template renders after that token at the end of a conversation (ChatML's `\\n`).
- `template_tokens`: every special token the template writes into a short conversation (a pad token must not be
  one of them).

A tokenizer without a chat template, or whose template ends the turn with plain text only, has no end-of-turn
token (None); callers fall back to its EOS.
"""

from __future__ import annotations

import warnings

_PROBE = "ds_rlhf end of turn probe"  # the assistant's content: plain words no template rewrites
_TURN = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _PROBE}]


def render(tokenizer, messages: list[dict], *, warn: bool = False) -> str | None:
    """`messages` rendered by the tokenizer's chat template, or None without a template or when the template
    refuses them (a template with rules the probe breaks: role order, a required system turn); `warn` says so."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja raises many types; the caller goes on without the template
        if warn:
            warnings.warn(f"the tokenizer's chat template cannot render a user/assistant conversation "
                          f"({type(exc).__name__}: {exc}); it names no end-of-turn token, the EOS ids stand in",
                          stacklevel=3)
        return None


def _after_probe(tokenizer) -> list[int] | None:
    """Token ids the template renders after the assistant's content of a one-turn conversation."""
    text = render(tokenizer, _TURN, warn=True)
    at = -1 if text is None else text.rfind(_PROBE)
    if at < 0:
        return None
    return tokenizer.encode(text[at + len(_PROBE):], add_special_tokens=False)


def _marks(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", ())) | set(getattr(tokenizer, "added_tokens_decoder", {}))


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template closes an assistant turn with: the first special or added token after the
    assistant's content in a rendered one-turn conversation. None without a chat template, or when the template
    ends the turn with plain text only."""
    tail = _after_probe(tokenizer)
    marks = _marks(tokenizer)
    return next((int(t) for t in tail or () if t in marks), None)


def end_of_turn_token(tokenizer) -> str | None:
    """`end_of_turn_id` as its token string (`<|im_end|>`), or None."""
    eot = end_of_turn_id(tokenizer)
    return None if eot is None else tokenizer.convert_ids_to_tokens(eot)


def turn_tail_ids(tokenizer, end_id: int) -> tuple[int, ...]:
    """The token ids the chat template renders after the final `end_id` of a conversation (ChatML: `\\n`); () without
    a template or when `end_id` is not in the rendering."""
    tail = _after_probe(tokenizer)
    if not tail or end_id not in tail:
        return ()
    after = len(tail) - tail[::-1].index(end_id)
    return tuple(int(i) for i in tail[after:])


def _special_strings(tokenizer) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = {tok.content for tok in added.values() if getattr(tok, "special", False)}
    names |= set(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(names, key=len, reverse=True)  # longest first: `<|im_end|>` before a token that prefixes it


def template_tokens(tokenizer) -> set[str]:
    """Special tokens the chat template writes into a short system/user/assistant conversation."""
    text = render(tokenizer, [{"role": "system", "content": "S"}, *_TURN]) or render(tokenizer, _TURN)
    return {name for name in _special_strings(tokenizer) if text and name in text}
