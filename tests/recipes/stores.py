"""Small hand-made prompt stores and RL configs for the preflight tests (no data prep, no model)."""

from __future__ import annotations

from ds_rlhf.config import parse_config


def prompt_store(tmp_path, tiny_model_path, name: str = "prompts", lengths=(4, 8, 6)):
    """A prompts store of one row per entry of `lengths` (that many tokens each), tokenized for the tiny model."""
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [{"input_ids": list(range(3, 3 + n)), "ground_truth": "1"} for n in lengths]
    out = tmp_path / name
    write_store(out, "prompts", rows, tokenizer_name=str(tiny_model_path),
                tokenizer_fingerprint=tokenizer_fingerprint(tok))
    return out


def rl_config(tmp_path, train, *extra):
    return parse_config(["--data.train", str(train), "--reward.fn", "gsm8k", "--run.output_dir",
                         str(tmp_path / "run"), *extra])
