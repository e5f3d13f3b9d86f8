"""Data: prep of user datasets into pre-tokenized Arrow stores, and fast, resumable reading of those stores.

* `prep` (+ `formats`, `convert`, `prep_core`, `writer`): JSONL / Parquet / saved datasets -> a store directory.
* `store`: `open_store` (refuses a store built with another tokenizer), `Store`, `tokenizer_fingerprint`.
* `readers`: io_uring + O_DIRECT block reads (aligned body, normal read for the tail) or mmap fallback.
* `loader`: `StoreLoader`, sharded per rank, shuffled per (seed, epoch), prefetched, exactly resumable.
* `packing`: length-grouped order, token-budget micro-batches, padding-free packing (cu_seqlens/position_ids).
* `synthetic`: stores for the built-in addition task.
"""

from .layout import KINDS, SCHEMAS
from .loader import StoreLoader
from .packing import (
    length_grouped_order,
    pack_sequences,
    packed_attention_mask,
    token_budget_microbatches,
    unpack_sequences,
)
from .store import Store, StoreMismatchError, check_store, open_store, tokenizer_fingerprint
from .store_checks import StoreFormatError

__all__ = [
    "KINDS", "SCHEMAS", "Store", "StoreFormatError", "StoreLoader", "StoreMismatchError", "check_store",
    "length_grouped_order", "open_store", "pack_sequences", "packed_attention_mask", "token_budget_microbatches",
    "tokenizer_fingerprint", "unpack_sequences",
]
