"""`ds-rlhf convert-gguf FILE.gguf OUT_DIR`: a GGUF model file (llama.cpp's format, quantized or not) -> a Hugging Face
safetensors directory (config, weights, tokenizer with its chat template, generation config) that transformers, vLLM
and the trainers load. Special tokens are made to agree with the chat template (eos = the end of an assistant turn,
a sane pad); what changed is printed and written to OUT_DIR/conversion.json. Needs the `gguf` package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_rlhf.engines.gguf_import import DTYPES, GGUFImportError, convert_gguf


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-rlhf convert-gguf", description=__doc__.split(": ", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: ds-rlhf convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2")
    p.add_argument("gguf_file", help="the .gguf model file")
    p.add_argument("out_dir", help="where the Hugging Face directory goes (written atomically)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the written weights (default: bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        convert_gguf(Path(args.gguf_file), Path(args.out_dir), args.dtype, overwrite=args.overwrite)
    except GGUFImportError as exc:
        print(f"ds-rlhf convert-gguf: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
