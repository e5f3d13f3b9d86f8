"""Where a reward model reads its score: one rule for RM training, RM evaluation, RL scoring and the export.

A reward model's score is its `score` head's output at the last token of a sequence, so that token must be the
same kind of token in every use, or the RM scores a position it was never trained on. Left alone the sequences
differ: a preference pair rendered by the chat template ends `<|im_end|>\\n` (ChatML renders a newline after each
turn), a rollout ends at its stop token `<|im_end|>`, a truncated rollout ends mid-text.

The rule (`score_ids`; OpenRLHF likewise appends the EOS when a sequence lacks it): a scored sequence ends with
exactly one score token, the chat template's end-of-turn token (`chat_tokens.end_of_turn_id`), or the tokenizer's
EOS when it has no chat template (or the template closes a turn with plain text), and the score is read there.

- the template's tail after the final end-of-turn token (ChatML's `\\n`) is removed;
- other stop tokens at the end (an EOS that is not the end-of-turn token, the pad token) are removed;
- a sequence that then does not end with the score token (a truncated response) gets it appended.

The rule is a function of the tokenizer only (`score_rule`), so every use with the same tokenizer reads the same
position. RM training and evaluation (`recipes/rm.py`) and RL's reward stage (`recipes/reward_stage.py`) pad the
sequences with `recipes.batching.pad_scored`.

The exported reward model reads the same position in plain Hugging Face transformers:
`*ForSequenceClassification` scores the rightmost token that is not `config.pad_token_id` (the attention mask plays
no part), so the export pads with a special token other than the score token (`export_pad_token`; the tokenizer's
own pad when it already differs), and `ds_rlhf_reward.json` beside the weights names the score token and the
template tail. A caller outside ds_rlhf ends its text there with `score_text`, or by hand: cut the template's text
after the final score token and append the score token when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_rlhf.engines.chat_tokens import end_of_turn_id, template_tokens, turn_tail_ids
from ds_rlhf.errors import ConfigError

REWARD_INFO = "ds_rlhf_reward.json"  # written beside an exported reward model


@dataclass(frozen=True)
class ScoreRule:
    """The score token; the chat template's tokens after it at the end of a rendered conversation; the other stop
    and pad tokens removed from a sequence's end."""

    score_id: int
    tail: tuple[int, ...] = ()
    strip: frozenset[int] = frozenset()


def score_rule(tokenizer) -> ScoreRule:
    """The rule for `tokenizer`: its chat template's end-of-turn token (else its EOS) and that template's tail. A
    tokenizer with neither is a ConfigError naming it."""
    score_id = end_of_turn_id(tokenizer)
    if score_id is None:
        score_id = tokenizer.eos_token_id
    if score_id is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"tokenizer {name!r} has neither a chat template with an end-of-turn token nor an EOS token: "
                          "a reward model reads its score at one of them; set the tokenizer's eos_token")
    score_id = int(score_id)
    others = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    strip = frozenset(int(i) for i in others if i is not None and int(i) != score_id)
    return ScoreRule(score_id=score_id, tail=turn_tail_ids(tokenizer, score_id), strip=strip)


def score_ids(ids, rule: ScoreRule) -> list[int]:
    """`ids` (a whole rendered conversation, or prompt + response) as the reward model scores it: ending with
    exactly one `rule.score_id`, where the score is read (see the module docstring)."""
    out = [int(i) for i in ids]
    n_tail = len(rule.tail)
    while True:
        if n_tail and len(out) > n_tail and tuple(out[-n_tail:]) == rule.tail and out[-n_tail - 1] == rule.score_id:
            del out[-n_tail:]
        elif out and out[-1] in rule.strip:
            out.pop()
        else:
            break
    if not out or out[-1] != rule.score_id:
        out.append(rule.score_id)
    return out


def score_text(text: str, tokenizer, rule: ScoreRule | None = None) -> list[int]:
    """Token ids of `text` (a chat-template rendering, or prompt + response text) ended by the rule: what plain
    transformers is given to score a conversation as ds_rlhf does."""
    return score_ids(tokenizer.encode(text, add_special_tokens=False), rule or score_rule(tokenizer))


def export_pad_token(tokenizer, rule: ScoreRule) -> tuple[str, int] | None:
    """The (token, id) an exported reward model pads with, so that `*ForSequenceClassification` never takes the
    score token for padding: the tokenizer's own pad when it is not the score token; else the first special token
    that is neither the score token nor one the chat template writes (the UNK first, then the others); else any
    special token other than the score token. None when every special token is the score token."""
    pad = tokenizer.pad_token_id
    if pad is not None and int(pad) != rule.score_id:
        return str(tokenizer.pad_token), int(pad)
    specials = [tokenizer.unk_token, *getattr(tokenizer, "all_special_tokens", ()), tokenizer.eos_token,
                tokenizer.bos_token]
    written = template_tokens(tokenizer)
    for allowed in (lambda t: t not in written, lambda t: True):
        for token in specials:
            if token is None or not allowed(token):
                continue
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and int(token_id) != rule.score_id:
                return str(token), int(token_id)
    return None


def reward_info(tokenizer, rule: ScoreRule) -> dict:
    """The content of `ds_rlhf_reward.json`: the token the score is read at, how a sequence is ended there, and the
    `pad_token_id` a `*ForSequenceClassification` config needs to read it (`export_pad_token`; a LoRA adapter's
    user sets it on the base model's config)."""
    pad = export_pad_token(tokenizer, rule)
    return {"score_token": tokenizer.convert_ids_to_tokens(rule.score_id), "score_token_id": rule.score_id,
            "template_tail_ids": list(rule.tail), "strip_ids": sorted(rule.strip),
            "pad_token_id": None if pad is None else pad[1],
            "rule": "the score is read at the last token; a scored sequence ends with exactly one score token: remove "
                    "the chat template's tail after the final score token (template_tail_ids) and any stop or pad "
                    "token after it (strip_ids), then append the score token when it is missing (a truncated "
                    "response)"}
