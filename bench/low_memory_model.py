"""The model and the data of bench/low_memory_gpu.py: the random-init Llama shapes and the per-shape run sizes, the
parameter count, building a model (in a child process: `low_memory_gpu.py --build-model`) and the random token
stores of every phase."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from low_memory_machine import BENCH, ROOT, GiB, child_env

SCRIPT = BENCH / "low_memory_gpu.py"  # the entry point; its --build-model is the child that builds a model

# Llama shapes, vocab 128256 (Llama-3 tokenizer size); "8b" is Llama-3 8B's shape.
LLAMA = dict(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
SHAPES = {
    "1b": dict(LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192,
               tie_word_embeddings=True),
    "3b": dict(LLAMA, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, intermediate_size=8192,
               tie_word_embeddings=True),
    "8b": dict(LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
               tie_word_embeddings=False),
    "13b": dict(LLAMA, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824,
                tie_word_embeddings=False),  # ~12.3B with GQA-8
    "20b": dict(LLAMA, hidden_size=6144, num_hidden_layers=48, num_attention_heads=48, intermediate_size=16384,
                tie_word_embeddings=False),  # ~20.3B
}
# Sizes of one phase per shape: sequence lengths, SFT/RM batch, RL prompts x samples.
RUN_SIZES = {
    "tiny": dict(seq_len=64, prompt_len=32, new_tokens=16, batch=4, prompts=2, samples=2),
    "default": dict(seq_len=512, prompt_len=128, new_tokens=256, batch=8, prompts=8, samples=4),
}


def params_of(shape: dict) -> int:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if shape["tie_word_embeddings"] else 2) + h


def build_random_llama(shape_name: str, out: Path) -> Path:
    """Random-init Llama of SHAPES[shape_name] in bf16, saved as safetensors with the tiny tokenizer. Built on the GPU
    when there is one (meta device -> to_empty -> normal_(0, 0.02), norms 1), written to a temp dir then renamed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ds_rlhf.engines.tiny_models import build_tiny_model

    if (out / "BUILT").exists():
        return out
    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    config = LlamaConfig(**SHAPES[shape_name], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.eos_token_id, torch_dtype="bfloat16")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
    tok.save_pretrained(tmp)
    (tmp / "BUILT").write_text(json.dumps({"shape": shape_name, "params": sum(p.numel() for p in model.parameters()),
                                           "seconds": time.time() - t0}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


def ensure_model(args, shape_name: str, gpu: bool) -> tuple[Path, dict]:
    """The model directory (built in a child process, so no CUDA context stays in this one during the phases)."""
    if shape_name == "tiny":
        from ds_rlhf.engines.tiny_models import build_tiny_model

        return build_tiny_model(), {"built": False}
    out = Path(args.workdir) / f"llama-{shape_name}"
    if (out / "BUILT").exists():
        return out, {"built": False}
    need = params_of(SHAPES[shape_name]) * 2
    free = shutil.disk_usage(Path(args.workdir)).free
    if free < need * 1.1:
        raise RuntimeError(f"building {shape_name} needs {need / GiB:.1f} GiB of disk in {args.workdir}, "
                           f"{free / GiB:.1f} GiB free")
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--build-model", shape_name,
                           "--workdir", str(args.workdir)], cwd=ROOT, env=child_env(gpu), capture_output=True,
                          text=True)
    if proc.returncode != 0 or not (out / "BUILT").exists():
        raise RuntimeError(f"building {shape_name} failed (exit {proc.returncode}): "
                           + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-8:]))
    print(f"[low_memory] built {out} in {time.time() - t0:.0f}s", flush=True)
    return out, {"built": True, "build_seconds": time.time() - t0}


def build_stores(workdir: Path, model_dir: Path, sizes: dict, steps: int) -> dict[str, Path]:
    """Random token rows: SFT rows of seq_len (loss on the second half), preference pairs of seq_len each, and
    prompts of prompt_len (`bench_inputs.build_prompts`); enough rows for `steps` steps (no eval split)."""
    import random

    from bench_inputs import build_prompts
    from transformers import AutoTokenizer

    from ds_rlhf.data.store import tokenizer_fingerprint
    from ds_rlhf.data.writer import write_store

    tok = AutoTokenizer.from_pretrained(model_dir)
    fp = tokenizer_fingerprint(tok)
    n, L = sizes["batch"] * (steps + 1), sizes["seq_len"]
    tag = f"{fp[:8]}-{L}-{n}"
    rng = random.Random(0)
    stores = {}
    sft = workdir / f"data/sft-{tag}"
    if not (sft / "manifest.json").exists():
        rows = [{"input_ids": [rng.randrange(10, 400) for _ in range(L)],
                 "loss_mask": [0] * (L // 2) + [1] * (L - L // 2), "row_id": i, "source_idx": 0} for i in range(n)]
        write_store(sft, "sft", rows, tokenizer_name=str(model_dir), tokenizer_fingerprint=fp)
    stores["sft"] = sft
    pref = workdir / f"data/preference-{tag}"
    if not (pref / "manifest.json").exists():
        rows = [{"chosen_ids": [rng.randrange(10, 400) for _ in range(L)],
                 "rejected_ids": [rng.randrange(10, 400) for _ in range(L)], "row_id": i, "source_idx": 0}
                for i in range(n)]
        write_store(pref, "preference", rows, tokenizer_name=str(model_dir), tokenizer_fingerprint=fp)
    stores["preference"] = pref
    pdir = workdir / f"data/p-{fp[:8]}-{sizes['prompts'] * (steps + 1)}"
    pdir.mkdir(parents=True, exist_ok=True)
    stores["prompts"] = build_prompts(pdir, model_dir, sizes["prompts"] * (steps + 1), sizes["prompt_len"])
    return stores
