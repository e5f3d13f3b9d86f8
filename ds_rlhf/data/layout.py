"""The on-disk layout of a pre-tokenized store, shared by the writer (data_prep) and the readers (training).

A store is a directory::

    manifest.json        what was read, how it was tokenized, what was dropped, and where every block lives
    data-00000.arrow     Arrow IPC *file* format; one record batch = one "block" (the unit of I/O)
    lengths.npy          int32 [rows, token columns]: per-row token counts, so samplers never touch the data
    dropped.jsonl        one line per input row that was not written (file, row, reason, detail)

The manifest records each block's byte offset and length inside its file. pyarrow does not expose those, and the
io_uring reader needs them to read exactly the blocks a batch touches (and to align those reads for O_DIRECT).
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LENGTHS = "lengths.npy"
DROPPED = "dropped.jsonl"
DATA_FILE = "data-{:05d}.arrow"

KINDS = ("prompts", "sft", "preference")

_TOKENS = pa.list_(pa.int32())
SCHEMAS: dict[str, pa.Schema] = {
    "prompts": pa.schema([
        ("input_ids", _TOKENS),          # chat template applied, ends with the generation prompt
        ("prompt_text", pa.string()),    # the rendered prompt (what the tokenizer saw)
        ("ground_truth", pa.string()),   # nullable: rule rewards compare against it
        ("data_source", pa.string()),    # routes a row to its reward function
        ("extra", pa.string()),          # nullable JSON: the source's other fields (verl extra_info, ability, ...)
        ("row_id", pa.int64()),          # line number (JSONL, 1-based) or row index (Parquet / HF dir, 0-based)
        ("source_idx", pa.int32()),      # index into manifest["sources"]: which input file row_id refers to
    ]),
    "sft": pa.schema([
        ("input_ids", _TOKENS),
        ("loss_mask", pa.list_(pa.int8())),  # 1 on assistant tokens, including their end-of-turn token
        ("row_id", pa.int64()),
        ("source_idx", pa.int32()),
    ]),
    "preference": pa.schema([
        ("chosen_ids", _TOKENS),    # full sequences (prompt + response), chat template applied
        ("rejected_ids", _TOKENS),
        ("row_id", pa.int64()),
        ("source_idx", pa.int32()),
    ]),
}
# The token columns whose lengths go into lengths.npy (in this column order).
TOKEN_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompts": ("input_ids",),
    "sft": ("input_ids",),
    "preference": ("chosen_ids", "rejected_ids"),
}


def schema_problem(path, kind: str) -> str | None:
    """Why the Arrow file at `path` cannot be a block file of a `kind` store (its columns are another kind's, or no
    kind's), read from the file's footer; None when its schema is the kind's."""
    with pa.memory_map(str(path)) as source:
        found = pa.ipc.open_file(source).schema.remove_metadata()
    if found == SCHEMAS[kind]:
        return None
    other = next((k for k, schema in SCHEMAS.items() if schema == found), None)
    holds = f"a {other!r} store's columns" if other else "columns of no store kind"
    return (f"the manifest says kind {kind!r} but {path} holds {holds} ({', '.join(found.names)}): the manifest was "
            "edited or belongs to another store; re-run data prep")
