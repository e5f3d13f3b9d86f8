"""Stores for the built-in addition task, so the demo and tests run the real data path end to end.

`write_addition_datasets` writes the task's rows as JSONL (the same files a user would bring) and runs the prep
functions on them, instead of writing stores directly, so the demo exercises exactly what users run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ds_rlhf.tasks.addition import preference_rows, prompt_rows, sft_rows

from .layout import MANIFEST
from .prep import prep_preferences, prep_prompts, prep_sft
from .store import load_tokenizer, tokenizer_fingerprint


def _is_current(store: Path, fingerprint: str, n: int, source: Path) -> bool:
    """Reuse a store built from the same JSONL with the same tokenizer (the demo calls this every run)."""
    try:
        m = json.loads((store / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (m["tokenizer"]["fingerprint"] == fingerprint and m["row_counts"]["read"] == n
            and m["sources"][0]["path"] == str(source.resolve()))


def write_addition_datasets(out_dir: str | os.PathLike, tokenizer_path, n_prompts: int = 512, n_sft: int = 512,
                            n_pref: int = 512, seed: int = 0, *, progress: bool = False,
                            max_len: int = 256, max_operand: int = 99,
                            sft_plain_fraction: float = 0.0) -> dict[str, Path]:
    """Write raw JSONL + stores for the addition task under `out_dir`; returns {kind: store path}.

    Prompts, SFT and preference rows use different seeds (seed, seed+1, seed+2) so the RL prompts are not the SFT
    demonstrations. Stores already built from identical inputs and tokenizer are reused.
    """
    out = Path(out_dir)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    tok, _ = load_tokenizer(tokenizer_path)
    fingerprint = tokenizer_fingerprint(tok)
    specs = {
        "prompts": (raw / "prompts.jsonl", prompt_rows(n_prompts, seed, max_operand), prep_prompts,
                    dict(input_key="prompt", label_key="label", max_prompt_len=max_len)),
        "sft": (raw / "sft.jsonl", sft_rows(n_sft, seed + 1, max_operand, sft_plain_fraction), prep_sft,
                dict(max_len=max_len)),
        "preference": (raw / "preferences.jsonl", preference_rows(n_pref, seed + 2, max_operand), prep_preferences,
                       dict(max_len=max_len)),
    }
    stores: dict[str, Path] = {}
    for kind, (src, rows, fn, kwargs) in specs.items():
        target = out / kind
        new_text = "".join(json.dumps(r) + "\n" for r in rows)
        unchanged = src.exists() and src.read_text(encoding="utf-8") == new_text
        if not unchanged:
            src.write_text(new_text, encoding="utf-8")
        if not (unchanged and _is_current(target, fingerprint, len(rows), src)):
            fn(src, target, tok, overwrite=True, on_error="fail", progress=progress, **kwargs)
        stores[kind] = target
    return stores
