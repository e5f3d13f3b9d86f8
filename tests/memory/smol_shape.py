"""The SmolLM2-135M shape the memory tests plan for (written as a config-only directory, no weights), the learning
bench's work on it (32 prompts x 8 samples, ~150-token prompts + 512 new tokens) and an 80 GB H100's memory.
Import the `smol` fixture into a test module to use it."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from ds_rlhf.memory.kv_cache import GiB

SMOL = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)
H100 = int(79.2 * GiB)
SMOL_WORK = ("--rl.prompts_per_step", "32", "--rollout.n_samples", "8", "--data.max_prompt_len", "150",
             "--rollout.max_new_tokens", "512")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol")
    LlamaConfig(**SMOL).save_pretrained(out)
    return str(out)
