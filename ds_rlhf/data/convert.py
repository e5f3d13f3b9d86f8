"""Row -> tokenized columns for each store kind, with the tokenizer's chat template applied at prep time.

Each converter is a callable ``(row, note) -> dict`` that raises `RowError` for a row it cannot use; `note(key)`
counts non-fatal events (truncation, trailing assistant turns removed) for the summary. Over-long rows follow the
`overlong` policy: "drop" raises RowError("too_long"), "truncate" cuts (prompts keep their *end*, so the generation
prompt survives; SFT and preference sequences keep their start).
"""

from __future__ import annotations

import json
import re

from .fields import MISSING, as_text, first_field, get_field, looks_like_hh, normalize_messages, parse_hh_transcript
from .row_checks import RowError

PROMPT_KEYS = ("prompt", "messages", "question", "problem", "query", "input", "instruction")
LABEL_KEYS = ("reward_model.ground_truth", "label", "ground_truth", "answer", "solution")
MESSAGES_KEYS = ("messages", "conversations", "conversation")
PROMPT_MESSAGES = "prompt_messages"  # key in a prompt row's `extra`: the chat messages of a conversational prompt


def row_prompt_messages(row: dict) -> list[dict] | None:
    """The chat messages a prompt store row was rendered from, or None for a text prompt."""
    extra = row.get("extra")
    return json.loads(extra).get(PROMPT_MESSAGES) if extra else None
PAIR_KEYS = (("prompt", "response"), ("prompt", "completion"), ("question", "answer"), ("instruction", "output"),
             ("input", "output"), ("prompt", "chosen"))
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Encoder:
    """Chat-template rendering and tokenization, with assistant-token masks.

    Templates with ``{% generation %}`` markers give the mask directly (transformers' assistant mask). Other
    templates get it by rendering the conversation prefix up to each assistant turn and diffing token ids; the
    span is cut after the turn's end-of-turn token (eos) so the newline a template adds after it is not trained on.
    """

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tok = tokenizer
        self.system_prompt = system_prompt
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.has_generation_tags = bool(template and _GENERATION_TAG.search(str(template)))
        self.eos_id = tokenizer.eos_token_id

    def with_system(self, messages: list[dict]) -> list[dict]:
        if self.system_prompt and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    def _need_template(self) -> None:
        if not self.has_template:
            raise RowError("no_chat_template", "the tokenizer has no chat template; pass --no-apply_chat_template "
                                               "for plain-text rows")

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        self._need_template()
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises many types (e.g. "roles must alternate")
            raise RowError("chat_template_error", str(exc)) from exc

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])

    def encode_conversation(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) for a full conversation; mask = 1 on assistant tokens incl. end-of-turn."""
        self._need_template()
        if self.has_generation_tags:
            try:
                out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            except Exception as exc:  # noqa: BLE001
                raise RowError("chat_template_error", str(exc)) from exc
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        ids = self.encode(self.render(messages, add_generation_prompt=False))
        mask = [0] * len(ids)
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = self.encode(self.render(messages[:i], add_generation_prompt=True)) if i else []
            through = self.encode(self.render(messages[: i + 1], add_generation_prompt=False))
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise RowError("chat_template_error", "the chat template is not prefix-stable, so assistant tokens "
                                                      "cannot be located; use a template with {% generation %} tags")
            end = len(through)
            turn = through[len(before):]
            if self.eos_id is not None and self.eos_id in turn:
                end = len(before) + len(turn) - turn[::-1].index(self.eos_id)
            mask[len(before):end] = [1] * (end - len(before))
        return ids, mask


def _prompt_messages(value, key: str, enc: Encoder, note) -> list[dict]:
    """A prompt field (text or message list) -> messages ending in a user/system turn."""
    if isinstance(value, str):
        if not value.strip():
            raise RowError("empty_prompt", f"field {key!r} is empty")
        return [{"role": "user", "content": value}]
    messages = normalize_messages(value)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # an RL prompt ends where the policy starts answering
        note("trailing_assistant_removed")
    if not messages or not any(m["content"].strip() for m in messages):
        raise RowError("empty_prompt", f"field {key!r} has no non-empty user/system message")
    return messages


def _too_long(n: int, limit: int, what: str) -> RowError:
    return RowError("too_long", f"{what} has {n} tokens > {limit}")


class PromptConverter:
    """RL prompts: text or messages -> input_ids ending with the generation prompt, plus ground truth/source."""

    def __init__(self, enc: Encoder, *, input_key="auto", label_key="auto", data_source_key="data_source",
                 data_source="unknown", apply_chat_template=True, input_template=None, extra_keys=None,
                 require_label=False, max_prompt_len=1024, overlong="drop"):
        self.enc = enc
        self.input_keys = PROMPT_KEYS if input_key == "auto" else (input_key,)
        self.label_keys = () if not label_key else LABEL_KEYS if label_key == "auto" else (label_key,)
        self.data_source_key, self.data_source = data_source_key, data_source
        self.apply_chat_template, self.input_template = apply_chat_template, input_template
        self.extra_keys, self.require_label = extra_keys, require_label
        self.max_len, self.overlong = max_prompt_len, overlong
        self.fields_used: dict[str, int] = {}

    def __call__(self, row: dict, note) -> dict:
        key, value = first_field(row, self.input_keys, "prompt")
        self.fields_used[f"prompt:{key}"] = self.fields_used.get(f"prompt:{key}", 0) + 1
        if isinstance(value, str) and self.input_template:
            value = self.input_template.replace("{}", value) if value.strip() else value
        if isinstance(value, str) and not self.apply_chat_template:
            if not value.strip():
                raise RowError("empty_prompt", f"field {key!r} is empty")
            text, ids = value, self.enc.encode(value, add_special_tokens=True)
        else:
            messages = self.enc.with_system(_prompt_messages(value, key, self.enc, note))
            text = self.enc.render(messages, add_generation_prompt=True)
            ids = self.enc.encode(text)
        if self.max_len and len(ids) > self.max_len:
            if self.overlong == "drop":
                raise _too_long(len(ids), self.max_len, "prompt")
            ids = ids[-self.max_len:]  # keep the end: the generation prompt must survive
            text = self.enc.tok.decode(ids, skip_special_tokens=False)
            note("truncated")
        truth, used = None, set()
        for k in self.label_keys:
            v = get_field(row, k)
            if v is not MISSING:
                truth, used = as_text(v), {k}
                self.fields_used[f"label:{k}"] = self.fields_used.get(f"label:{k}", 0) + 1
                break
        if truth is None and self.require_label:
            raise RowError("missing_field", f"no ground-truth field (tried {', '.join(self.label_keys)})")
        source = get_field(row, self.data_source_key) if self.data_source_key else MISSING
        skip = {key, self.data_source_key} | used
        if self.extra_keys is None:
            extra = {k: v for k, v in row.items() if k not in skip}
        else:
            extra = {k: row[k] for k in self.extra_keys if k in row}
        if not isinstance(value, str):  # a conversational prompt: its messages
            extra[PROMPT_MESSAGES] = messages  # reach TRL-style reward functions as TRL passes them
        return {"input_ids": ids, "prompt_text": text, "ground_truth": truth,
                "data_source": self.data_source if source is MISSING else str(source),
                "extra": json.dumps(extra, ensure_ascii=False, default=str) if extra else None}


class SFTConverter:
    """SFT: messages (or prompt/response pairs) -> input_ids + loss_mask on assistant tokens only."""

    def __init__(self, enc: Encoder, *, messages_key="auto", prompt_key="auto", response_key="auto",
                 apply_chat_template=True, max_len=2048, overlong="drop"):
        self.enc = enc
        self.messages_keys = MESSAGES_KEYS if messages_key == "auto" else (messages_key,) if messages_key else ()
        if prompt_key == "auto" and response_key == "auto":
            self.pairs = PAIR_KEYS
        else:
            self.pairs = ((prompt_key, response_key),)
        self.apply_chat_template, self.max_len, self.overlong = apply_chat_template, max_len, overlong

    def conversation(self, row: dict):
        """(messages, None) or (None, (prompt, response)) for plain-text rows without a template."""
        for key in self.messages_keys:
            value = get_field(row, key)
            if value is not MISSING:
                return self.enc.with_system(normalize_messages(value)), None
        for pk, rk in self.pairs:
            prompt, response = get_field(row, pk), get_field(row, rk)
            if prompt is not MISSING and response is not MISSING:
                if not isinstance(response, str):
                    raise RowError("bad_messages", f"field {rk!r} is {type(response).__name__}, not text")
                if not response.strip():
                    raise RowError("empty_response", f"field {rk!r} is empty")
                if isinstance(prompt, str) and not self.apply_chat_template:
                    if not prompt.strip():
                        raise RowError("empty_prompt", f"field {pk!r} is empty")
                    return None, (prompt, response)
                head = _prompt_messages(prompt, pk, self.enc, lambda _k: None)
                return self.enc.with_system(head + [{"role": "assistant", "content": response}]), None
        tried = list(self.messages_keys) + [f"{p}+{r}" for p, r in self.pairs]
        raise RowError("missing_field", f"no conversation (tried {', '.join(tried)}; row has {', '.join(sorted(row))})")

    def __call__(self, row: dict, note) -> dict:
        messages, pair = self.conversation(row)
        if pair is not None:
            p_ids = self.enc.encode(pair[0], add_special_tokens=True)
            r_ids = self.enc.encode(pair[1]) + ([self.enc.eos_id] if self.enc.eos_id is not None else [])
            ids, mask = p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids)
        else:
            if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
                raise RowError("no_assistant_turn", "the conversation has no non-empty assistant message")
            if not any(m["role"] != "assistant" and m["content"].strip() for m in messages):
                raise RowError("empty_prompt", "the conversation has no non-empty user/system message")
            ids, mask = self.enc.encode_conversation(messages)
        if self.max_len and len(ids) > self.max_len:
            if self.overlong == "drop":
                raise _too_long(len(ids), self.max_len, "sequence")
            ids, mask = ids[: self.max_len], mask[: self.max_len]
            if not any(mask):
                raise RowError("too_long", f"no assistant tokens left after truncating to {self.max_len}")
            note("truncated")
        if not any(mask):
            raise RowError("no_assistant_turn", "no assistant tokens in the encoded conversation")
        return {"input_ids": ids, "loss_mask": mask}


class PreferenceConverter:
    """Preference pairs -> full chosen/rejected token sequences (chat template applied)."""

    def __init__(self, enc: Encoder, *, chosen_key="chosen", rejected_key="rejected", prompt_key="auto",
                 max_len=2048, overlong="drop"):
        self.enc = enc
        self.chosen_key, self.rejected_key = chosen_key, rejected_key
        self.prompt_keys = ("prompt",) if prompt_key == "auto" else (prompt_key,) if prompt_key else ()
        self.max_len, self.overlong = max_len, overlong

    def _side(self, value, key: str, prompt) -> list[dict]:
        if isinstance(value, str):
            if looks_like_hh(value):
                messages = parse_hh_transcript(value)
            elif prompt is not MISSING:
                head = _prompt_messages(prompt, "prompt", self.enc, lambda _k: None)
                messages = head + [{"role": "assistant", "content": value}]
            else:
                raise RowError("bad_messages", f"{key!r} is plain text and the row has no prompt field")
        else:
            messages = normalize_messages(value)
            if prompt is not MISSING and messages[0]["role"] == "assistant":
                messages = _prompt_messages(prompt, "prompt", self.enc, lambda _k: None) + messages
        if messages[-1]["role"] != "assistant":
            raise RowError("bad_messages", f"{key!r} does not end with an assistant turn")
        if not any(m["role"] != "assistant" and m["content"].strip() for m in messages):
            raise RowError("empty_prompt", f"{key!r} has no non-empty user/system message")
        return self.enc.with_system(messages)

    def __call__(self, row: dict, note) -> dict:
        chosen = get_field(row, self.chosen_key)
        rejected = get_field(row, self.rejected_key)
        for key, value in ((self.chosen_key, chosen), (self.rejected_key, rejected)):
            if value is MISSING:
                raise RowError("missing_field", f"no {key!r} field (row has {', '.join(sorted(row))})")
        prompt = MISSING
        for k in self.prompt_keys:
            prompt = get_field(row, k)
            if prompt is not MISSING:
                break
        c_ids = self.enc.encode(self.enc.render(self._side(chosen, self.chosen_key, prompt), False))
        r_ids = self.enc.encode(self.enc.render(self._side(rejected, self.rejected_key, prompt), False))
        if c_ids == r_ids:
            raise RowError("identical_pair", "chosen and rejected encode to the same tokens")
        longest = max(len(c_ids), len(r_ids))
        if self.max_len and longest > self.max_len:
            if self.overlong == "drop":
                raise _too_long(longest, self.max_len, "chosen/rejected")
            c_ids, r_ids = c_ids[: self.max_len], r_ids[: self.max_len]
            if c_ids == r_ids:
                raise RowError("too_long", f"chosen and rejected are identical in their first {self.max_len} tokens")
            note("truncated")
        return {"chosen_ids": c_ids, "rejected_ids": r_ids}
