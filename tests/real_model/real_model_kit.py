"""Shared by the real-model tests, their conftest and grpo_worker.py (run as a script from this folder)."""

from __future__ import annotations

import torch

# a short answer, so that some of the RL test's 64-token responses end their turn (worked answers run longer)
GSM8K_INSTRUCTION = 'Give only the final answer, as "#### <number>".'


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], eos: int, new_tokens: int) -> list[list[int]]:
    """Greedy response ids per prompt (transformers generate), up to and including the first `eos`."""
    model.eval()
    out = []
    for prompt in prompts:
        ids = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos, use_cache=True)
        out.append(ids[0, len(prompt):].tolist())
    return out
