"""The GPU benchmarks' inputs: a random-init Qwen2-shaped model (0.5B / 1.5B, vocab 151936, bf16) with the offline
tiny tokenizer, and a prompt store of prompts of exactly one length (`bench/rl_step_gpu.py` and the benches that
share its rollout shape).
"""

from __future__ import annotations

import random
from pathlib import Path

SHAPES = {  # Qwen2 shapes, vocab 151936
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=4096),
}


def build_model(workdir: Path, tiny: bool, shape: str = "0.5b") -> Path:
    """Random-init Qwen2 (0.5B / 1.5B shape, or the tiny one) saved with the offline tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from ds_rlhf.engines.tiny_models import build_tiny_model

    tiny_dir = build_tiny_model()
    if tiny:
        return tiny_dir
    out = workdir / f"qwen2-{shape}-shape"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=shape == "0.5b", eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_prompts(workdir: Path, model_dir: Path, n: int, prompt_len: int) -> Path:
    """`n` prompts of exactly `prompt_len` tokens: chat header + random token ids + generation prompt."""
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(model_dir)
    head = tok.apply_chat_template([{"role": "user", "content": "X"}], add_generation_prompt=True, return_dict=False)
    x = head.index(tok.convert_tokens_to_ids("X")) if "X" in tok.get_vocab() else len(head) // 2
    prefix, suffix = head[:x], head[x + 1 :]
    body = prompt_len - len(prefix) - len(suffix)
    rng = random.Random(0)
    rows = [{"input_ids": prefix + [rng.randrange(10, 400) for _ in range(body)] + suffix, "prompt_text": "",
             "ground_truth": None, "data_source": "bench", "extra": None, "row_id": i, "source_idx": 0}
            for i in range(n)]
    out = workdir / f"prompts-{prompt_len}"
    return write_store(out, "prompts", rows, tokenizer_name=str(model_dir),
                       tokenizer_fingerprint=tokenizer_fingerprint(tok))
