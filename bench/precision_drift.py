"""A float32 model against its own weights rounded to bf16 (what a bf16 rollout engine serves) as Adam steps add up.

Each step is one AdamW step on a fixed batch of worked arithmetic answers (the same-sign updates of early training).
Every `--every` steps the probe (held-out answers of the same kind) is scored three ways: by the float32 model, by
the float32 model under bf16 autocast (its matmuls read the rounded weights), and by a bf16 copy of the model (the
engine). Per way: KL(engine || way) per position, and the mean and max abs difference of the probe tokens'
log-probs (what the sync canary judges). CPU, a few minutes for SmolLM2-135M:

    ds-rlhf convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python bench/precision_drift.py --model models/smollm2 --lr 2e-5 --steps 40 --out drift.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

TRAIN = [(12, 3, 7), (45, 6, 2), (8, 9, 11), (70, 4, 5), (33, 2, 13), (5, 17, 3), (61, 8, 8), (19, 7, 6)]
PROBE = [(91, 17), (40, 23), (77, 8), (150, 66)]


def chat(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question} End with #### N.<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>"


def texts() -> tuple[list[str], list[str]]:
    train = [chat(f"What is {a} + {b} * {c}?", f"First {b} * {c} = {b * c}. Then {a} + {b * c} = {a + b * c}.\n"
                  f"#### {a + b * c}") for a, b, c in TRAIN]
    probe = [chat(f"What is {a} - {b}?", f"The answer is {a - b}.\n#### {a - b}") for a, b in PROBE]
    return train, probe


@torch.no_grad()
def log_probs(model, batch, autocast: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    return F.log_softmax(logits[:, :-1], -1)


def compare(way: torch.Tensor, engine: torch.Tensor, batch) -> dict:
    mask = batch.attention_mask[:, 1:].bool()
    kl = (engine.exp() * (engine - way)).sum(-1)[mask].mean().item()
    target = batch.input_ids[:, 1:, None]
    diff = (way.gather(-1, target) - engine.gather(-1, target)).squeeze(-1).abs()[mask]
    return {"kl_engine_way": kl, "mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item()}


def point(model, probe, step: int, start: list[torch.Tensor]) -> dict:
    """The three ways at this step; `start`: the weights' bf16 rounding at step 0."""
    engine = copy.deepcopy(model).to(torch.bfloat16)
    served = log_probs(engine, probe)
    moved = sum((p.detach().to(torch.bfloat16) != q).sum().item() for p, q in zip(model.parameters(), start))
    return {"step": step, "weights_whose_rounding_moved": moved,
            "float32": compare(log_probs(model, probe), served, probe),
            "float32_autocast_bf16": compare(log_probs(model, probe, autocast=True), served, probe)}


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (bf16 weights, loaded as float32)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("precision_drift.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train, probe = (tok(t, return_tensors="pt", padding=True) for t in texts())
    labels = train.input_ids.masked_fill(train.attention_mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]
    points = []
    for step in range(args.steps + 1):
        if step:
            opt.zero_grad()
            model(input_ids=train.input_ids, attention_mask=train.attention_mask, labels=labels).loss.backward()
            opt.step()
        if step % args.every == 0:
            points.append(point(model, probe, step, start))
            print(json.dumps(points[-1]), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "lr": args.lr, "points": points}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
