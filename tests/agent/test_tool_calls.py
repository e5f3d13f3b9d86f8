"""Tool calls read from generated text: Hermes/Qwen `<tool_call>` JSON blocks and plain `name(...)` lines; malformed
calls come back as an error sentence, never an exception."""

from __future__ import annotations

import pytest

from ds_rlhf.agent.tool_calls import ToolCall, parse_tool_calls

TOOLS = {"calculator": ["expression"], "add": ["a", "b"]}


def test_hermes_calls_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.error is None and parsed.format == "hermes"
    assert parsed.calls == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("add", {"a": 1, "b": 2})]


def test_plain_calls_positional_and_keyword():
    assert parse_tool_calls('I will use it:\ncalculator("2 + 3")', TOOLS).calls == [
        ToolCall("calculator", {"expression": "2 + 3"})]
    assert parse_tool_calls("add(1, b=5)", TOOLS).calls == [ToolCall("add", {"a": 1, "b": 5})]
    # a call of something that is not a tool is prose, and nothing is evaluated
    assert not parse_tool_calls('print("hi")\nThe answer is 5', TOOLS).has_calls
    assert not parse_tool_calls("The answer is 5.", TOOLS).has_calls


@pytest.mark.parametrize("text, words", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}', "not closed"),
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "no tool named 'rm_rf'"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>', "no parameter c"),
    ("add(1, 2, 3)", "takes 2 argument(s)"),
    ("calculator(__import__('os'))", "literal arguments"),
])
def test_malformed_calls_are_an_error_sentence(text, words):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == [] and parsed.has_calls
    assert words in parsed.error
