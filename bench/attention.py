"""Time the attention back-ends on this device, so ``ds_rlhf.engines.attention.select_attn_impl`` is measured.

For each implementation (eager, sdpa, torch_varlen = torch.nn.attention.varlen, flash_attention_2) and each batch
layout it runs forward+backward of a small Qwen2-shaped decoder (0.5B attention shape: hidden 896, 14 heads, 2 KV
heads; 2 layers, small vocab, so attention dominates) on the same sequences:

- ``padded``: B rows right-padded to the longest sequence, with an attention mask;
- ``packed``: one row, no padding, ``position_ids`` restarting at 0 per sequence (transformers builds the
  block-diagonal mask for sdpa/eager from them; varlen/flash get cu_seqlens).

Every run's loss is compared with sdpa-padded (same weights, same tokens) so a fast-but-wrong kernel is flagged.
An implementation that cannot run here (e.g. varlen on CPU) is recorded with its error. ``--save-choice`` stores the
fastest correct implementation for this device+dtype where ``select_attn_impl("auto")`` reads it.

    python bench/attention.py [--device cuda] [--dtype bf16] [--json out.json] [--save-choice]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ds_rlhf.engines import attention as attn

IMPLS = ("eager", "sdpa", attn.VARLEN_NAME, "flash_attention_2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_batches(lengths: list[int], vocab: int, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    packed = torch.cat(seqs).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    # Labels per sequence: the first token of each packed sequence must not be predicted from the previous one.
    plabels = torch.cat([torch.cat([s[:1].new_full((1,), -100), s[1:]]) for s in seqs]).unsqueeze(0)
    plabels_shift = torch.cat([plabels[:, 1:], plabels.new_full((1, 1), -100)], 1)
    return {
        "padded": dict(input_ids=ids.to(device), attention_mask=mask.to(device)),
        "padded_labels": torch.cat([labels[:, 1:], labels.new_full((len(seqs), 1), -100)], 1).to(device),
        "packed": dict(input_ids=packed.to(device), position_ids=pos.to(device)),
        "packed_labels": plabels_shift.to(device),
    }


def loss_of(model, inputs, labels):
    logits = model(**inputs, use_cache=False).logits.float()  # a KV cache disables packed-mask detection
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


def time_one(model, inputs, labels, repeats: int, device: str) -> tuple[float, float]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    loss = loss_of(model, inputs, labels)  # warm-up (kernel selection, allocator)
    loss.backward()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, inputs, labels)
        loss.backward()
    sync()
    return (time.perf_counter() - start) / repeats, loss.item()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default depends on device)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--save-choice", action="store_true", help="record the fastest correct impl for this device")
    return p


def main(argv=None) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    args = build_parser().parse_args(argv)
    device = args.device
    dtype = DTYPES[args.dtype or ("bf16" if device.startswith("cuda") else "fp32")]
    on_gpu = device.startswith("cuda")
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
               ([2048, 1024, 512, 256, 256] * 2 if on_gpu else [256, 128, 64, 64]))
    repeats = args.repeats or (20 if on_gpu else 3)
    config = Qwen2Config(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=4 * args.hidden, max_position_embeddings=max(lengths) + 1,
                         tie_word_embeddings=True)
    batches = make_batches(lengths, config.vocab_size, device)
    attn.register_torch_varlen()
    torch.manual_seed(0)
    state = Qwen2ForCausalLM(config).state_dict()
    results, reference = [], None
    for impl in ["sdpa"] + [i for i in IMPLS if i != "sdpa"]:
        for layout in ("padded", "packed"):
            row = {"impl": impl, "layout": layout}
            try:
                config._attn_implementation = impl
                model = Qwen2ForCausalLM(config)
                model.load_state_dict(state)
                model.to(device=device, dtype=dtype).train()
                seconds, loss = time_one(model, batches[layout], batches[f"{layout}_labels"], repeats, device)
                reference = loss if reference is None else reference
                rel = abs(loss - reference) / abs(reference)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                row.update(ok=rel <= tol, ms=round(seconds * 1e3, 3), loss=loss, rel_diff_vs_sdpa_padded=rel,
                           tokens_per_s=round(sum(lengths) / seconds, 1))
            except Exception as exc:  # noqa: BLE001 - record why an implementation is unusable here
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            results.append(row)
            print(json.dumps(row), flush=True)
    good = [r for r in results if r["ok"]]
    best = min(good, key=lambda r: r["ms"]) if good else None
    out = {"device": attn.device_key(device), "dtype": str(dtype).removeprefix("torch."),
           "torch": torch.__version__, "lengths": lengths, "repeats": repeats,
           "shape": {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "layers": args.layers},
           "results": results, "choice": best and best["impl"], "choice_layout": best and best["layout"],
           "date": time.strftime("%Y-%m-%d")}
    print(f"fastest correct: {out['choice']} ({out['choice_layout']})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.save_choice and best:
        save_choice(out, best)
    return out


def save_choice(out: dict, best: dict) -> None:
    """Record the fastest correct implementation for this device and dtype in `attn.choice_path()`."""
    path = attn.choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[f"{out['device']}|{out['dtype']}"] = {"impl": best["impl"], "layout": best["layout"],
                                                "ms": best["ms"], "date": out["date"]}
    path.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"saved choice to {path}")


if __name__ == "__main__":
    main()
