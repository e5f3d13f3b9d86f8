"""Data preparation commands (`ds-rlhf-prep-*`, `ds-rlhf prep-*`, `python data_prep/prep_*.py`).

Each `main_*` parses argv, writes the store and prints its summary; it returns 0, or 2 with the reason on bad
input. The logic and the options live in `ds_rlhf.data.prep`.
"""

from __future__ import annotations

from ds_rlhf.data.prep import cli


def _cli(name: str, argv: list[str] | None) -> int:
    return cli(name, argv)


def main_prompts(argv: list[str] | None = None) -> int:
    """RL prompts (verl parquet, OpenRLHF JSONL, saved datasets) -> a tokenized prompt store."""
    return _cli("prep_prompts", argv)


def main_gsm8k(argv: list[str] | None = None) -> int:
    """GSM8K (official question/answer JSONL) -> RL prompts with ground truth, or SFT."""
    return _cli("prep_gsm8k", argv)


def main_sft(argv: list[str] | None = None) -> int:
    """SFT demonstrations (messages or prompt/response pairs) -> an `sft` store with assistant-only loss masks."""
    return _cli("prep_sft", argv)


def main_preferences(argv: list[str] | None = None) -> int:
    """Reward-model preference pairs (HH-RLHF, UltraFeedback-binarized, prompt+responses) -> a `preference` store."""
    return _cli("prep_preferences", argv)
