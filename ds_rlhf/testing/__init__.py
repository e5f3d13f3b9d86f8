"""Offline test kit: tiny tokenizer and models built locally, never downloaded (see `ds_rlhf.testing.tiny`)."""
