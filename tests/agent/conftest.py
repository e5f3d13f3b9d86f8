"""Fixtures of the agent tests."""

from __future__ import annotations

import json

import pytest

from ds_rlhf.data.prep import prep_prompts
from tests.agent.test_rl_episodes import QUESTIONS


@pytest.fixture(scope="session")
def arithmetic_store(tiny_model_path, tmp_path_factory):
    """A prompts store of plain questions (no chat template: the episode runner renders the prompt with the tools)
    with their answers as ground truth."""
    out = tmp_path_factory.mktemp("arithmetic")
    raw = out / "prompts.jsonl"
    raw.write_text("".join(json.dumps({"prompt": q, "label": str(a)}) + "\n" for q, a in QUESTIONS))
    prep_prompts(raw, out / "store", str(tiny_model_path), input_key="prompt", label_key="label",
                 apply_chat_template=False, progress=False, overwrite=True, on_error="fail")
    return out / "store"
