"""The stack the pipeline stands on: vLLM (CPU) generates with log-probs; DeepSpeed trains on the CPU accelerator."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ds_rlhf.testing.multiproc import clean_env


def test_broken_vision_packages_absent():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed; it breaks against this torch"


@pytest.mark.extended
@pytest.mark.slow
def test_vllm_loads_tiny_model_and_returns_logprobs(tiny_model_path, tmp_path):
    """In a subprocess, so vLLM's own process setup cannot leak into the rest of the session."""
    import json
    import subprocess
    import sys

    script = tmp_path / "gen.py"
    script.write_text(f"""
import json, os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model={str(tiny_model_path)!r}, dtype="float32", distributed_executor_backend="uni",
              max_model_len=128, enforce_eager=True, seed=0)
    outs = llm.generate([{{"prompt_token_ids": [1, 5, 6, 7]}}] * 2,
                        SamplingParams(n=2, max_tokens=8, logprobs=0, temperature=1.0, ignore_eos=True),
                        use_tqdm=False)
    res = [[c.token_ids, [next(iter(d.values())).logprob for d in c.logprobs]] for o in outs for c in o.outputs]
    print("RESULT" + json.dumps(res))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    samples = json.loads(line[len("RESULT"):])
    assert len(samples) == 4
    for token_ids, logprobs in samples:
        assert len(token_ids) == 8 and len(logprobs) == 8
        assert all(lp <= 0.0 for lp in logprobs)


def test_deepspeed_zero2_takes_a_step_on_cpu(tiny_model_path, dist_single):
    import deepspeed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    batch = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    changed = [n for n, p in engine.module.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
