"""The token ids an episode adds around the model's turns, from the tokenizer's chat template.

- `prompt_ids`: the first user message (with the tools, where the template shows them), rendered with the
  generation prompt.
- `observation_ids`: what follows an assistant turn the model generated: the rest of the template's closing of that
  turn (ChatML: the `\\n` after `<|im_end|>`; all of `<|im_end|>\\n` when the turn was cut before its end token),
  the observation turns (tool results as `tool` turns, an environment's observation as a `user` turn), and the
  next assistant turn's generation prompt. It is found by rendering a probe conversation with and without the
  observation turns and taking the difference, so the model's own tokens are never decoded and re-encoded.

Templates that cannot render a `tool` turn (they raise, drop it, or rewrite the conversation before it) get the
tool results as a plain user turn (`Tool NAME returned:` + the result); templates that ignore `tools=` get the
tools described in the first user message, with the plain call format `name(arguments)` that `tool_calls.py` reads.
"""

from __future__ import annotations

import json

from ds_rlhf.errors import ConfigError

_PROBE_USER = "ds_rlhf probe question"
_PROBE_ANSWER = "ds_rlhf probe answer"
_PROBE_RESULT = "ds_rlhf probe result"


def plain_tool_turn(message: dict) -> dict:
    """A tool turn as a user turn, for templates without a tool role."""
    return {"role": "user", "content": f"Tool {message.get('name', 'tool')} returned:\n{message['content']}"}


def tool_instructions(specs: list[dict]) -> str:
    """The tools in words, for templates that do not render `tools=`."""
    lines = ["You can call a tool by writing one line `name(arguments)`, e.g. "
             f"{specs[0]['function']['name']}(...). The tools:"]
    for spec in specs:
        fn = spec["function"]
        params = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in fn["parameters"].get("properties", {}).items())
        lines.append(f"- {fn['name']}({params}): {fn.get('description', '')}")
    return "\n".join(lines)


class ChatRenderer:
    """Renders an episode's non-generated parts with `tokenizer`'s chat template (see the module docstring)."""

    def __init__(self, tokenizer, *, system_prompt: str | None = None, tools: list[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("agent episodes need a tokenizer with a chat template: this tokenizer has none (set "
                              "tokenizer.chat_template, or use a chat model's tokenizer)")
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.tools = tools or None
        self.tools_in_template = bool(self.tools) and self._shows_tools()
        self.tool_role = self._tool_role_works()
        self._suffixes: dict[tuple[str, ...], tuple[str, str]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools if self.tools_in_template else None,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def _shows_tools(self) -> bool:
        messages = [{"role": "user", "content": _PROBE_USER}]
        try:
            with_tools = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False)
        except Exception:  # noqa: BLE001  a template that cannot take tools= describes them in words instead
            return False
        return with_tools != self.tokenizer.apply_chat_template(messages, tokenize=False) and \
            json.dumps(self.tools[0]["function"]["name"]).strip('"') in with_tools

    def _tool_role_works(self) -> bool:
        try:
            self._difference([{"role": "tool", "name": "probe", "content": _PROBE_RESULT}])
        except Exception:  # noqa: BLE001  jinja raises many types: the template has no tool turn
            return False
        return True

    def _difference(self, turns: list[dict]) -> tuple[str, str]:
        """(closing, suffix): the template's text after an assistant turn's content, and the text `turns` add after
        it up to the next generation prompt."""
        base = [*self._head(), {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_ANSWER}]
        text_a = self._render(base, False)
        text_b = self._render(base + turns, True)
        at = text_a.rfind(_PROBE_ANSWER)
        if at < 0 or not text_b.startswith(text_a) or any(t["content"] not in text_b[len(text_a):] for t in turns):
            raise ValueError("the template does not append these turns after an assistant turn")
        return text_a[at + len(_PROBE_ANSWER):], text_b[len(text_a):]

    def first_message(self, text: str) -> str:
        if self.tools and not self.tools_in_template:
            return f"{text}\n\n{tool_instructions(self.tools)}"
        return text

    def prompt_ids(self, first_user_message: str) -> list[int]:
        messages = [*self._head(), {"role": "user", "content": self.first_message(first_user_message)}]
        return self.encode(self._render(messages, True))

    def observation_turns(self, messages: list[dict]) -> list[dict]:
        """`messages` as the template renders them: tool turns become user turns where it has no tool turn."""
        if self.tool_role:
            return messages
        return [plain_tool_turn(m) if m["role"] == "tool" else m for m in messages]

    def observation_text(self, messages: list[dict], turn_closed_by: str | None) -> str:
        """The text after an assistant turn: the rest of its closing, the observation turns, the next generation
        prompt. `turn_closed_by`: the text of the token the model ended its turn with (None: cut before its end)."""
        turns = self.observation_turns(messages)
        try:
            closing, suffix = self._difference(turns)
        except Exception as exc:  # noqa: BLE001
            roles = sorted({t["role"] for t in turns})
            raise ConfigError(f"the tokenizer's chat template cannot render {'/'.join(roles)} turns after an "
                              f"assistant turn ({exc}); give a chat template that can") from None
        if turn_closed_by and closing.startswith(turn_closed_by):
            closing = closing[len(turn_closed_by):]
        return closing + suffix

    def observation_ids(self, messages: list[dict], turn_closed_by: str | None) -> list[int]:
        return self.encode(self.observation_text(messages, turn_closed_by))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
