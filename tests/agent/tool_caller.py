"""A tiny model that sometimes calls the calculator: the tiny kit's model after a short supervised run on calculator
episodes, rendered exactly as the episode runner renders them (`ChatRenderer`, the tools described in the user
message, the tool result as a `tool` turn).

Two phases: first every example calls the calculator on the question's expression and answers with the tool's
result (the model learns the call format and to copy the result); then a mixture where `tool_fraction` of the
examples do that and the rest answer without the tool, with no number, so a direct answer never scores. The
questions are two-digit multiplications with four-digit products, which the tiny model cannot do in its head."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_rlhf.agent.environment import tool_specs
from ds_rlhf.agent.examples.calculator import calculator
from ds_rlhf.agent.rendering import ChatRenderer
from ds_rlhf.engines.chat_tokens import end_of_turn_id, end_of_turn_token

DIRECT_ANSWER = "I cannot compute that."


def multiplication(rng: random.Random) -> tuple[str, int, str]:
    """(question, answer, expression): two two-digit factors whose product has four digits."""
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a * b >= 1000:
            return f"What is {a} * {b}?", a * b, f"{a} * {b}"


def example(renderer: ChatRenderer, eot: int, eot_text: str, rng: random.Random, tool: bool):
    """(token ids, loss mask): one episode, the mask 1 on the assistant's tokens."""
    question, answer, expression = multiplication(rng)
    ids = renderer.prompt_ids(question)
    mask = [0] * len(ids)

    def add(part: list[int], m: int) -> None:
        ids.extend(part)
        mask.extend([m] * len(part))

    if tool:
        add(renderer.encode(f'calculator("{expression}")') + [eot], 1)
        add(renderer.observation_ids([{"role": "tool", "name": "calculator", "content": str(answer)}], eot_text), 0)
        add(renderer.encode(f"The answer is {answer}.") + [eot], 1)
    else:
        add(renderer.encode(DIRECT_ANSWER) + [eot], 1)
    return ids, mask


def train_tool_caller(base: Path, out: Path, *, tool_steps: int = 300, mix_steps: int = 40,
                      tool_fraction: float = 0.2, batch: int = 16, lr: float = 3e-3, seed: int = 0) -> Path:
    """Train `base` (a tiny-kit model directory) as the module docstring says; save the model and its tokenizer
    to `out`."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    renderer = ChatRenderer(tokenizer, tools=tool_specs([calculator]))
    eot, eot_text = end_of_turn_id(tokenizer), end_of_turn_token(tokenizer)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = tool_steps + mix_steps
    for step in range(total):
        fraction = 1.0 if step < tool_steps else tool_fraction
        rows = [example(renderer, eot, eot_text, rng, rng.random() < fraction) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r, _ in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)[:, 1:]
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        for group in optimizer.param_groups:  # 10 warmup steps, then linear decay to 10% of lr
            group["lr"] = lr * min((step + 1) / 10, 1.0 - 0.9 * step / total)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
