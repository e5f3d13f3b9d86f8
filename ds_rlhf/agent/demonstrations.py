"""Demonstration episodes: scripted assistant turns played through an environment and written as the chat
conversation an episode of the policy would be, for supervised fine-tuning before RL (a warm start that shows a
model the tool-call format the environment reads, which GRPO can only raise once samples show it).

`tool_call_demonstration(env, renderer, row, call, answer)` resets `env` with `row`, steps it with the text of
`call` in the format the episode runner's prompt asks for (`<tool_call>` JSON where the chat template shows the
tools, else the plain `name("...")` line that the first user message describes; `tool_calls.format_tool_call`),
then with `answer`, and returns the conversation: the first user message as `ChatRenderer` renders it (with the
tools described where the template does not show them), the two assistant turns, and the environment's
observation turns as the template renders them (`tool` turns, or user turns where the template has no tool role).
Rendered by the chat template (without `tools=`), it is token for token the episode the runner would have played
with those turns (`tests/agent/test_demonstrations.py`). The environment must accept it: the call must run without
a report and the answer must end the episode, else `ValueError` says what it did instead; its reward is returned.
"""

from __future__ import annotations

from typing import Any

from ds_rlhf.agent.environment import run_reset, run_step
from ds_rlhf.agent.rendering import ChatRenderer
from ds_rlhf.agent.tool_calls import ToolCall, format_tool_call


def call_format(renderer: ChatRenderer) -> str:
    """The tool-call format an episode's prompt asks the model for: "hermes" where the chat template shows the
    tools (its format), else "plain" (`rendering.tool_instructions`)."""
    return "hermes" if renderer.tools_in_template else "plain"


def tool_call_demonstration(env: Any, renderer: ChatRenderer, row: Any, call: ToolCall,
                            answer: str) -> tuple[list[dict], float]:
    """(messages, reward) of the two-turn episode `call`, then `answer` (module docstring)."""
    params = getattr(env, "params", {}).get(call.name, list(call.arguments))
    call_text = format_tool_call(call, call_format(renderer), params)
    head = [{"role": "system", "content": renderer.system_prompt}] if renderer.system_prompt else []
    messages = [*head, {"role": "user", "content": renderer.first_message(run_reset(env, row))},
                {"role": "assistant", "content": call_text}]
    called = run_step(env, call_text)
    if called.done or called.reports or not called.messages:
        raise ValueError(f"the environment did not run the call {call_text!r} cleanly (done={called.done}, "
                         f"reports={called.reports}, observation={called.observation!r})")
    messages += renderer.observation_turns(called.messages)
    messages.append({"role": "assistant", "content": answer})
    final = run_step(env, answer)
    if not final.done:
        raise ValueError(f"the environment did not end the episode at the answer {answer!r} "
                         f"(observation={final.observation!r})")
    return messages, called.reward + final.reward
