"""Test helpers (multi-process workers). The offline tiny tokenizer and models live in `ds_rlhf.engines.tiny_models`;
production code never imports this package."""
