"""The main job on the built-in tiny default.

Until the trainer lands this is the smoke path: build the tiny model offline, start vLLM (CPU) in-process, and
generate answers to a few synthetic addition prompts with per-token log-probs.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from ds_rlhf.tasks.addition import make_problems
    from ds_rlhf.testing.tiny import build_tiny_model

    t0 = time.time()
    path = build_tiny_model()
    tok = AutoTokenizer.from_pretrained(path)
    print(f"[1/2] tiny model ready at {path} ({time.time() - t0:.1f}s)")
    llm = LLM(model=str(path), dtype="float32", distributed_executor_backend="uni", max_model_len=256,
              enforce_eager=True, seed=0)
    problems = make_problems(4, seed=0)
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p.prompt}],
                                                            add_generation_prompt=True, return_dict=False)}
               for p in problems]
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, logprobs=0, seed=0), use_tqdm=False)
    print(f"[2/2] vLLM generated {sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {time.time() - t0:.2f}s")
    for p, o in zip(problems, outs):
        c = o.outputs[0]
        mean_lp = sum(next(iter(d.values())).logprob for d in c.logprobs) / max(1, len(c.logprobs))
        print(f"  {p.prompt!r} -> {tok.decode(c.token_ids)!r}  (mean log-prob {mean_lp:.2f}; untrained model)")


if __name__ == "__main__":
    main()
