"""Demonstration episodes (`agent/demonstrations.py`) and the tool-call writer (`tool_calls.format_tool_call`): a
written call parses back to itself, and a demonstration's conversation, tokenized as SFT data prep tokenizes it, is
the episode the runner plays with the same turns, token for token, with the SFT loss exactly on its generated
tokens."""

from __future__ import annotations

import pytest
from scripted_policy import ScriptedPolicy

from ds_rlhf.agent.demonstrations import call_format, tool_call_demonstration
from ds_rlhf.agent.episode import EpisodeRunner
from ds_rlhf.agent.examples.calculator import CalculatorEnv
from ds_rlhf.agent.rendering import ChatRenderer
from ds_rlhf.agent.tool_calls import ToolCall, format_tool_call, parse_tool_calls
from ds_rlhf.data.convert import Encoder
from ds_rlhf.engines.chat_tokens import end_of_turn_id
from ds_rlhf.rollout import SamplingSpec
from tests.agent.test_episode import NO_TOOL_ROLE, QWEN_LIKE, with_template

TOOLS = {"calculator": ["expression"], "search": ["query", "limit"]}


@pytest.mark.parametrize("fmt", ["plain", "hermes"])
@pytest.mark.parametrize("call", [
    ToolCall("calculator", {"expression": "(12 + 3) * 4"}),
    ToolCall("calculator", {"expression": 'say "hi"\\n\tand \u00e9'}),
    ToolCall("search", {"query": "a", "limit": 3}),
    ToolCall("search", {"limit": 3}),  # not the first parameter: by keyword
])
def test_a_written_tool_call_parses_back_to_the_same_call(fmt, call):
    text = format_tool_call(call, fmt, TOOLS[call.name])
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.error is None and parsed.format == fmt and parsed.calls == [call], text


def test_plain_calls_are_positional_where_the_arguments_are_the_first_parameters():
    assert format_tool_call(ToolCall("calculator", {"expression": "2 + 3"}), "plain", ["expression"]) == \
        'calculator("2 + 3")'
    assert format_tool_call(ToolCall("search", {"limit": 3}), "plain", TOOLS["search"]) == "search(limit=3)"
    with pytest.raises(ValueError, match="hermes"):
        format_tool_call(ToolCall("calculator", {}), "xml")


@pytest.mark.parametrize("template", ["tiny", "no_tool_role", "qwen_like"])
def test_a_demonstration_is_the_episode_the_runner_plays_token_for_token(tiny_tokenizer, template):
    tok = {"tiny": tiny_tokenizer, "qwen_like": with_template(tiny_tokenizer, QWEN_LIKE),
           "no_tool_role": with_template(tiny_tokenizer, NO_TOOL_ROLE)}[template]
    renderer = ChatRenderer(tok, tools=CalculatorEnv().specs)
    assert call_format(renderer) == ("hermes" if template == "qwen_like" else "plain")
    row = {"prompt": "Mia has 9 boxes with 8 cards in each box. Then Mia loses 5 cards. How many?", "answer": "67"}
    messages, reward = tool_call_demonstration(CalculatorEnv(), renderer, row,
                                               ToolCall("calculator", {"expression": "9 * 8 - 5"}), "#### 67")
    assert reward == 1.0 and [m["role"] for m in messages] == (
        ["user", "assistant", "tool" if template != "no_tool_role" else "user", "assistant"])
    assert messages[2]["content"].endswith("67")  # the calculator's result, in the template's tool turn
    # the runner plays the demonstration's assistant turns: its environment reads the call and runs it
    eot = end_of_turn_id(tok)
    policy = ScriptedPolicy(tok, {"Mia has": [messages[1]["content"], messages[3]["content"]]}, eot)
    (ep,) = EpisodeRunner(policy, tok, CalculatorEnv, SamplingSpec(max_new_tokens=256, seed=0), max_turns=3).run([row])
    assert (ep.end, ep.turns, ep.tool_turns, ep.reward, ep.reports) == ("done", 2, 1, 1.0, []), ep.reports
    if template == "qwen_like":  # the tools go in through the template's tools= (which SFT prep does not pass)
        ids = tok.encode(tok.apply_chat_template(messages, tools=renderer.tools, tokenize=False),
                         add_special_tokens=False)
        mask = None
    else:  # SFT data prep's tokenization: the whole conversation, loss mask on the assistant turns
        ids, mask = Encoder(tok).encode_conversation(messages)
    n = len(ep.token_ids)
    assert ids[:n] == ep.token_ids  # after it, only the template's closing of the last turn
    assert tok.decode(ids[n:]).strip() == ""
    if mask is not None:
        assert mask[:n] == ep.loss_mask and not any(mask[n:])  # SFT trains exactly the tokens the policy generates


def test_a_demonstration_the_environment_does_not_accept_is_an_error(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer, tools=CalculatorEnv().specs)
    row = {"prompt": "What is 1 / 0?", "answer": "0"}
    with pytest.raises(ValueError, match="did not run the call"):
        tool_call_demonstration(CalculatorEnv(), renderer, row, ToolCall("calculator", {"expression": "1 / 0"}),
                                "#### 0")
    with pytest.raises(ValueError, match="did not end the episode"):
        tool_call_demonstration(CalculatorEnv(), renderer, row, ToolCall("calculator", {"expression": "1 + 0"}),
                                'calculator("1 + 1")')
