"""Tool calls parsed out of a model's generated text.

Two formats:
- Hermes / Qwen (Qwen2.5, Qwen3, Hermes, and the chat templates that copy them): one or more
  `<tool_call>{"name": "...", "arguments": {...}}</tool_call>` blocks; `arguments` may also be a JSON string holding
  an object, as some models write it.
- Plain, for models without a tool format (the tiny test model, the calculator example): a line that is nothing but
  a call of a known tool with literal arguments, `calculator("2 + 3")` or `calculator(expression="2 + 3")`, read
  with `ast` (literals only, nothing is evaluated); positional arguments take the tool's parameters in order.

A malformed call is not an exception: `parse_tool_calls` returns it as `error`, one sentence the caller shows the
model as its observation so it can correct itself; so is a call nested deeper than `MAX_DEPTH` levels (whatever a
model writes, the parser never raises, RecursionError included). `format_tool_call` writes a call in either format,
as a model would (demonstrations): `parse_tool_calls` reads it back to the same call.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_TAGGED = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
MAX_DEPTH = 32  # levels of lists/objects in one call's JSON or literal arguments
_TOO_DEEP = f"the tool call nests lists/objects more than {MAX_DEPTH} levels deep: pass flat arguments"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedCalls:
    """What a generated turn asked for: `calls` (in order), or `error` (a sentence for the model), or neither (the
    turn calls no tool: a final answer)."""

    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None
    format: str | None = None  # "hermes" | "plain" | None

    @property
    def has_calls(self) -> bool:
        return bool(self.calls) or self.error is not None


def parse_tool_calls(text: str, tools: Mapping[str, Sequence[str]] | None = None) -> ParsedCalls:
    """The tool calls in `text`. `tools` maps each known tool name to its parameter names (in order): a call of
    another name is an error, and plain calls are only recognised for these names. Without `tools`, any name is
    accepted in the tagged format and plain calls are not looked for."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = []
        for body, close in tagged:
            if not close:
                return ParsedCalls(error="a <tool_call> block is not closed: end it with </tool_call>",
                                   format="hermes")
            call, error = _hermes_call(body.strip(), tools)
            if error:
                return ParsedCalls(error=error, format="hermes")
            calls.append(call)
        return ParsedCalls(calls=calls, format="hermes")
    if tools:
        for line in text.splitlines():
            found = _plain_call(line.strip(), tools)
            if found is not None:
                call, error = found
                return ParsedCalls(calls=[] if error else [call], error=error, format="plain")
    return ParsedCalls()


def _depth(value) -> int:
    """Levels of lists/dicts in `value` (iterative: a deep value cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, depth + 1)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _hermes_call(body: str, tools) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): write " \
                     '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
    except RecursionError:
        return None, _TOO_DEEP
    if _depth(obj) > MAX_DEPTH:
        return None, _TOO_DEEP
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'the tool call needs a "name" string: write {"name": "...", "arguments": {...}}'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f'the "arguments" of the call to {obj["name"]} are not a JSON object'
        except RecursionError:
            return None, _TOO_DEEP
        if _depth(args) > MAX_DEPTH:
            return None, _TOO_DEEP
    if not isinstance(args, dict):
        return None, f'the "arguments" of the call to {obj["name"]} must be a JSON object, got {type(args).__name__}'
    return _checked(obj["name"], args, tools)


def _plain_call(line: str, tools) -> tuple[ToolCall | None, str | None] | None:
    """(call, error) when `line` is a call of a known tool, None when it is not a call at all."""
    match = re.fullmatch(r"`?([A-Za-z_]\w*)\s*\((.*)\)`?", line)
    if not match or match.group(1) not in tools:
        return None
    name = match.group(1)
    try:
        node = ast.parse(line.strip("`"), mode="eval").body
        if not isinstance(node, ast.Call):
            raise SyntaxError("not a call")
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise ValueError("**arguments")
    except (SyntaxError, ValueError, TypeError) as exc:
        return None, f"the call to {name} cannot be read ({type(exc).__name__}): give literal arguments, " \
                     f'e.g. {name}("...")'
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        return None, _TOO_DEEP
    if _depth([*args, *kwargs.values()]) > MAX_DEPTH:
        return None, _TOO_DEEP
    params = list(tools[name])
    if len(args) > len(params):
        return None, f"{name} takes {len(params)} argument(s) ({', '.join(params)}), got {len(args)}"
    kwargs = {**dict(zip(params, args)), **kwargs}
    return _checked(name, kwargs, tools)


def _checked(name: str, args: dict, tools) -> tuple[ToolCall | None, str | None]:
    if tools is not None and name not in tools:
        return None, f"there is no tool named {name!r}: the tools are {', '.join(sorted(tools)) or 'none'}"
    if tools is not None:
        unknown = sorted(set(args) - set(tools[name]))
        if unknown:
            return None, f"{name} has no parameter {', '.join(unknown)}: its parameters are " \
                         f"{', '.join(tools[name]) or 'none'}"
    return ToolCall(name, dict(args)), None


def format_tool_call(call: ToolCall, fmt: str, params: Sequence[str] = ()) -> str:
    """The text of `call` in format `fmt`: "hermes", a `<tool_call>` block of JSON; "plain", one line `name(...)`
    with literal arguments, positional where they are the first of the tool's `params` in order (`calculator("2 +
    3")`), else by keyword. `parse_tool_calls(text, {call.name: params})` reads it back to `call`."""
    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"
    if fmt != "plain":
        raise ValueError(f"tool-call format {fmt!r}: use 'hermes' or 'plain'")
    positional = list(call.arguments) == list(params)[: len(call.arguments)]
    args = [_literal(v) if positional else f"{k}={_literal(v)}" for k, v in call.arguments.items()]
    return f"{call.name}({', '.join(args)})"


def _literal(value) -> str:
    """A Python literal `ast.literal_eval` reads back to `value` (strings double-quoted, as JSON writes them)."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    if ast.literal_eval(text) != value:
        raise ValueError(f"{value!r} cannot be written as a literal argument")
    return text
