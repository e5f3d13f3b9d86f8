"""Public data-prep entry points (functions and their CLIs): RL prompts, GSM8K, SFT, preference pairs.

Every function takes the input file(s)/dir(s) or Hugging Face Hub dataset names, the output store directory and
a tokenizer (an object, a local directory or a Hub id, resolved by `ds_rlhf.engines.model_source`), and returns a
`PrepResult` (os.PathLike, with `.manifest` and `.summary()`). Bad input is never a silent success: writing 0 rows
raises `DataPrepError` (naming the inputs and why their rows were dropped) unless ``allow_empty=True``, and so does
an input that cannot be read (a Hub name not in the cache while offline among them). The `data_prep/*.py` scripts
are thin wrappers over `cli(...)` here, so the scripts and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

from ds_rlhf.engines.model_source import resolve_model_source
from ds_rlhf.errors import ConfigError

from .convert import Encoder, PreferenceConverter, PromptConverter, SFTConverter
from .fields import gsm8k_answer
from .formats import DataPrepError, RowError, is_hub_dataset_name, load_hub_dataset
from .prep_core import PrepResult, run_prep

__all__ = ["prep_prompts", "prep_gsm8k", "prep_sft", "prep_preferences", "PrepResult", "DataPrepError", "cli"]

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a length or a batch size; 0 or -5 would silently mangle every row)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def local_tokenizer(tokenizer):
    """A tokenizer object as it is; a spec (local directory, Hub id `org/name[@revision]`, `tiny`) as the local
    directory it resolves to. A Hub id is read from the HF cache, downloaded only when online (HF_HUB_OFFLINE unset),
    and only its tokenizer files; one not cached while offline is a one-line `DataPrepError`."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    try:
        return resolve_model_source(str(tokenizer), "--tokenizer", "tokenizer")
    except ConfigError as exc:
        raise DataPrepError(str(exc)) from None


def local_inputs(inputs, split: str | None = None) -> list:
    """The inputs with each Hub dataset name (`org/name[:config]` that is not on disk) loaded as its `split`
    (default train; `formats.load_hub_dataset`); files and directories as they are."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    return [load_hub_dataset(item, split) if is_hub_dataset_name(item) else item for item in items]


def _common(on_error, overlong, split, overwrite, progress, block_rows, allow_empty) -> dict:
    if overlong not in ("drop", "truncate"):
        raise ValueError(f"overlong must be 'drop' or 'truncate', got {overlong!r}")
    return dict(on_error=on_error, split=split, overwrite=overwrite, progress=progress, block_rows=block_rows,
                allow_empty=allow_empty)


def prep_prompts(inputs, output, tokenizer, *, input_key="auto", label_key="auto", data_source_key="data_source",
                 data_source=None, apply_chat_template=True, input_template=None, system_prompt=None,
                 extra_keys=None, require_label=False, max_prompt_len=1024, overlong="drop", on_error="skip",
                 split=None, overwrite=False, progress=True, block_rows=2048, allow_empty=False) -> PrepResult:
    """RL prompts from verl parquet (prompt = messages, reward_model.ground_truth), OpenRLHF JSONL
    (--input_key/--label_key) or any JSONL/Parquet/saved-dataset with a text or messages prompt field."""
    options = dict(input_key=input_key, label_key=label_key, data_source_key=data_source_key,
                   data_source=data_source, apply_chat_template=apply_chat_template, input_template=input_template,
                   system_prompt=system_prompt, extra_keys=extra_keys, require_label=require_label, overlong=overlong)

    def make(enc: Encoder):
        return PromptConverter(enc, input_key=input_key, label_key=label_key, data_source_key=data_source_key,
                               data_source=data_source or "unknown", apply_chat_template=apply_chat_template,
                               input_template=input_template, extra_keys=extra_keys, require_label=require_label,
                               max_prompt_len=max_prompt_len, overlong=overlong)

    return run_prep("prompts", local_inputs(inputs, split), output, local_tokenizer(tokenizer), make,
                    created_by="prep_prompts", options=options,
                    max_lengths={"max_prompt_len": max_prompt_len},
                    **_common(on_error, overlong, split, overwrite, progress, block_rows, allow_empty))


class _GSM8KRows:
    """GSM8K {question, answer} -> the generic converters' input (prompt + label / prompt + response)."""

    def __init__(self, inner, instruction: str, kind: str):
        self.inner, self.instruction, self.kind = inner, instruction, kind
        self.fields_used = getattr(inner, "fields_used", {})

    def __call__(self, row: dict, note) -> dict:
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise RowError("missing_field", f"no {key!r} text field (row has {', '.join(sorted(row))})")
        if not row["question"].strip():
            raise RowError("empty_prompt", "field 'question' is empty")
        truth = gsm8k_answer(row["answer"])
        prompt = row["question"].strip() + (" " + self.instruction if self.instruction else "")
        if self.kind == "sft":
            return self.inner({"prompt": prompt, "response": row["answer"]}, note)
        return self.inner({"prompt": prompt, "label": truth, "data_source": "openai/gsm8k",
                           "answer": row["answer"]}, note)


def prep_gsm8k(inputs, output, tokenizer, *, kind="prompts", instruction=GSM8K_INSTRUCTION, system_prompt=None,
               max_prompt_len=1024, max_len=2048, overlong="drop", on_error="skip", split=None, overwrite=False,
               progress=True, block_rows=2048, allow_empty=False) -> PrepResult:
    """GSM8K's official {question, answer} JSONL: prompts with ground truth = the number after '####' (kind
    "prompts", data_source "openai/gsm8k"), or question -> worked answer conversations (kind "sft")."""
    if kind not in ("prompts", "sft"):
        raise ValueError(f"kind must be 'prompts' or 'sft', got {kind!r}")
    options = dict(kind=kind, instruction=instruction, system_prompt=system_prompt, overlong=overlong)

    def make(enc: Encoder):
        if kind == "sft":
            inner = SFTConverter(enc, prompt_key="prompt", response_key="response", max_len=max_len,
                                 overlong=overlong)
        else:
            inner = PromptConverter(enc, input_key="prompt", label_key="label", data_source="openai/gsm8k",
                                    max_prompt_len=max_prompt_len, overlong=overlong)
        return _GSM8KRows(inner, instruction, kind)

    limits = {"max_len": max_len} if kind == "sft" else {"max_prompt_len": max_prompt_len}
    return run_prep(kind, local_inputs(inputs, split), output, local_tokenizer(tokenizer), make,
                    created_by="prep_gsm8k", options=options,
                    max_lengths=limits,
                    **_common(on_error, overlong, split, overwrite, progress, block_rows, allow_empty))


def prep_sft(inputs, output, tokenizer, *, messages_key="auto", prompt_key="auto", response_key="auto",
             apply_chat_template=True, system_prompt=None, max_len=2048, overlong="drop", on_error="skip",
             split=None, overwrite=False, progress=True, block_rows=2048, allow_empty=False) -> PrepResult:
    """SFT demonstrations: `messages` conversations (or ShareGPT `conversations`) or prompt/response pairs;
    the loss mask covers assistant tokens only (with their end-of-turn token)."""
    options = dict(messages_key=messages_key, prompt_key=prompt_key, response_key=response_key,
                   apply_chat_template=apply_chat_template, system_prompt=system_prompt, overlong=overlong)

    def make(enc: Encoder):
        return SFTConverter(enc, messages_key=messages_key, prompt_key=prompt_key, response_key=response_key,
                            apply_chat_template=apply_chat_template, max_len=max_len, overlong=overlong)

    return run_prep("sft", local_inputs(inputs, split), output, local_tokenizer(tokenizer), make,
                    created_by="prep_sft", options=options,
                    max_lengths={"max_len": max_len},
                    **_common(on_error, overlong, split, overwrite, progress, block_rows, allow_empty))


def prep_preferences(inputs, output, tokenizer, *, chosen_key="chosen", rejected_key="rejected", prompt_key="auto",
                     system_prompt=None, max_len=2048, overlong="drop", on_error="skip", split=None,
                     overwrite=False, progress=True, block_rows=2048, allow_empty=False) -> PrepResult:
    """Reward-model pairs: chosen/rejected as HH-RLHF transcripts, message lists (UltraFeedback-binarized), or
    response strings with a prompt field. Both sides are stored as full chat-templated sequences."""
    options = dict(chosen_key=chosen_key, rejected_key=rejected_key, prompt_key=prompt_key,
                   system_prompt=system_prompt, overlong=overlong)

    def make(enc: Encoder):
        return PreferenceConverter(enc, chosen_key=chosen_key, rejected_key=rejected_key, prompt_key=prompt_key,
                                   max_len=max_len, overlong=overlong)

    return run_prep("preference", local_inputs(inputs, split), output, local_tokenizer(tokenizer), make,
                    created_by="prep_preferences", options=options,
                    max_lengths={"max_len": max_len},
                    **_common(on_error, overlong, split, overwrite, progress, block_rows, allow_empty))


# -- command lines ----------------------------------------------------------------------------------------------
def _parser(prog: str, doc: str, example: str) -> argparse.ArgumentParser:
    doc = inspect.cleandoc(doc) + "\n\nWrites a store dir: manifest.json, data-*.arrow, lengths.npy, dropped.jsonl."
    p = argparse.ArgumentParser(prog=prog, description=doc, epilog=f"example:\n  {example}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer: a local Hugging Face directory or a Hub id "
                                                      "(org/name[@revision], from the HF cache; downloaded only "
                                                      "when online). Its chat template is applied now, and its "
                                                      "fingerprint goes in the manifest")
    p.add_argument("--input", required=True, nargs="+", help="JSONL (.jsonl/.jsonl.gz), JSON array, Parquet, a "
                                                             "datasets.save_to_disk dir, a dir of such files, or a "
                                                             "Hub dataset name org/name[:config] (datasets."
                                                             "load_dataset; from its cache when offline)")
    p.add_argument("--output", required=True, help="store directory to create (manifest.json + Arrow files)")
    p.add_argument("--split", default=None, help="split to read from a saved DatasetDict or a Hub dataset "
                                                 "(default for a Hub dataset: train)")
    p.add_argument("--on-error", "--on_error", dest="on_error", choices=("skip", "fail"), default="skip",
                   help="bad rows (malformed JSON, missing fields, empty prompts, ...): skip = count, report with "
                        "line numbers and go on; fail = stop at the first one (default: skip)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drop", dest="overlong", action="store_const", const="drop", default="drop",
                   help="drop rows longer than the max length (default; counted and reported)")
    g.add_argument("--truncate", dest="overlong", action="store_const", const="truncate",
                   help="truncate over-long rows instead (prompts keep their end, sequences their start)")
    p.add_argument("--system_prompt", default=None, help="system message added to conversations without one")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --output (the new store "
                                                            "is built beside it and swapped in when complete)")
    p.add_argument("--allow-empty", "--allow_empty", dest="allow_empty", action="store_true",
                   help="write a store even when no row is kept (default: 0 rows kept is an error naming the "
                        "input and the drops by reason)")
    p.add_argument("--block_rows", type=_positive_int, default=2048, help="rows per Arrow record batch (the I/O unit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--apply_chat_template", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the tokenizer's chat template to text prompts (default: yes; message lists are "
                        "always templated)")


def build_parser(name: str) -> argparse.ArgumentParser:
    if name == "prep_prompts":
        p = _parser("prep_prompts.py", prep_prompts.__doc__,
                    "python data_prep/prep_prompts.py --tokenizer TOK --input train.parquet --output stores/rl")
        p.add_argument("--input_key", default="auto", help="prompt field, text or chat messages; dots reach into "
                                                           "nested fields (default: first of prompt, messages, "
                                                           "question, problem, query, input, instruction)")
        p.add_argument("--label_key", default="auto", help="ground-truth field (default: first of "
                                                           "reward_model.ground_truth, label, ground_truth, answer, "
                                                           "solution); '' for none")
        p.add_argument("--data_source_key", default="data_source", help="field naming the reward function")
        p.add_argument("--data_source", default=None, help="data_source for rows without that field")
        _template_flag(p)
        p.add_argument("--input_template", default=None, help="wrap text prompts, e.g. 'Question: {}\\nAnswer:'")
        p.add_argument("--extra_keys", nargs="*", default=None, help="fields kept in the JSON `extra` column "
                                                                     "(default: all fields not used above)")
        p.add_argument("--require_label", action="store_true", help="a row without ground truth is an error")
        p.add_argument("--max_prompt_len", type=_positive_int, default=1024, help="max prompt tokens (default 1024)")
    elif name == "prep_gsm8k":
        p = _parser("prep_gsm8k.py", prep_gsm8k.__doc__,
                    "python data_prep/prep_gsm8k.py --tokenizer TOK --input gsm8k/train.jsonl --output stores/gsm8k")
        p.add_argument("--kind", choices=("prompts", "sft"), default="prompts", help="store kind to write")
        p.add_argument("--instruction", default=GSM8K_INSTRUCTION, help="text appended to each question")
        p.add_argument("--max_prompt_len", type=_positive_int, default=1024, help="max prompt tokens (kind prompts)")
        p.add_argument("--max_len", type=_positive_int, default=2048, help="max sequence tokens (kind sft)")
    elif name == "prep_sft":
        p = _parser("prep_sft.py", prep_sft.__doc__,
                    "python data_prep/prep_sft.py --tokenizer TOK --input chats.jsonl --output stores/sft")
        p.add_argument("--messages_key", default="auto", help="conversation field (default: messages, "
                                                              "conversations, conversation)")
        p.add_argument("--prompt_key", "--input_key", dest="prompt_key", default="auto", help="prompt field of "
                       "prompt/response pairs (default: tries prompt/response, prompt/completion, question/answer, "
                       "instruction/output, input/output)")
        p.add_argument("--response_key", "--output_key", dest="response_key", default="auto",
                       help="response field of prompt/response pairs")
        _template_flag(p)
        p.add_argument("--max_len", type=_positive_int, default=2048, help="max sequence tokens (default 2048)")
    elif name == "prep_preferences":
        p = _parser("prep_preferences.py", prep_preferences.__doc__,
                    "python data_prep/prep_preferences.py --tokenizer TOK --input hh.jsonl.gz --output stores/rm")
        p.add_argument("--chosen_key", default="chosen", help="chosen side: transcript, messages or response")
        p.add_argument("--rejected_key", default="rejected", help="rejected side")
        p.add_argument("--prompt_key", default="auto", help="prompt field used when the sides are bare "
                                                            "responses (default: prompt)")
        p.add_argument("--max_len", type=_positive_int, default=2048, help="max tokens per side (default 2048)")
    else:
        raise ValueError(f"unknown prep command {name!r}")
    return p


_FUNCS = {"prep_prompts": prep_prompts, "prep_gsm8k": prep_gsm8k, "prep_sft": prep_sft,
          "prep_preferences": prep_preferences}


def cli(name: str, argv=None) -> int:
    """Parse `argv`, run the prep, print the summary. Exit code 0, or 2 with the reason on one stderr line (no
    traceback) on bad input: unreadable files, 0 rows kept, a bad row under --on-error fail, ..."""
    args = vars(build_parser(name).parse_args(argv))
    inputs, output, tokenizer = args.pop("input"), args.pop("output"), args.pop("tokenizer")
    args["progress"] = not args.pop("quiet")
    try:
        result = _FUNCS[name](inputs, output, tokenizer, **args)
    except DataPrepError as exc:
        print(f"{name}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the temp store is already removed; an existing store at --output is untouched
        print(f"{name}: error: interrupted (Ctrl-C); nothing was written at {output}", file=sys.stderr)
        return 130
    print(result.summary())
    return 0
