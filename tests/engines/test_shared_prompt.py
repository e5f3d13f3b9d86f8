"""The shared-prompt passes (`engines/shared_prompt.py`) through DeepSpeed engines: the same updates as padded rows at
ZeRO-2 and ZeRO-3, with LoRA and with gradient checkpointing, and the LoRA base as reference (`model.share_base`)."""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.engines.builder import build_actor, build_shared_reference
from ds_rlhf.engines.hf_export import gather_state_dict
from ds_rlhf.engines.models import unwrap
from ds_rlhf.engines.policy_forward import sequence_logprobs
from ds_rlhf.engines.shared_prompt import shared_prompt_logprobs, supports_shared_prompt
from ds_rlhf.recipes.shared_prompt_batch import share_prompts
from tests.engines.workers import resolved

STEPS = 2
LORA = {"r": 8, "lora_alpha": 32}


def _rows(seed: int = 5):
    """Right-padded prompt + response rows: 3 groups (prompts of 4, 7, 2 tokens) of 3 samples."""
    gen = torch.Generator().manual_seed(seed)
    rows, p_lens, r_lens, groups = [], [], [], []
    for g, p in enumerate((4, 7, 2)):
        prompt = torch.randint(5, 400, (p,), generator=gen)
        for _ in range(3):
            r = int(torch.randint(1, 6, (1,), generator=gen))
            rows.append(torch.cat([prompt, torch.randint(5, 400, (r,), generator=gen)]))
            p_lens.append(p), r_lens.append(r), groups.append(g)
    width = max(len(x) for x in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(rows):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    p_lens, r_lens = torch.tensor(p_lens), torch.tensor(r_lens)
    t = torch.arange(width - 1)[None, :]
    acting = ((t >= p_lens[:, None] - 1) & (t < (p_lens + r_lens)[:, None] - 1)).float()
    return ids, mask, acting, p_lens, r_lens, torch.tensor(groups)


def _logprobs(model, rows, shared: bool):
    ids, mask, acting, p_lens, r_lens, groups = rows
    if not shared:
        return sequence_logprobs(model, ids, mask, with_entropy=True, chunk_size=16, score_mask=acting > 0)
    layout = share_prompts(ids, p_lens, r_lens, groups)
    logp, entropy = shared_prompt_logprobs(model, layout.inputs(acting > 0), with_entropy=True, chunk_size=16)
    return layout.unpack(logp), layout.unpack(entropy)


def _train(model_path, config: str, shared: bool, lora: dict | None, checkpointing: bool):
    """Parameters after `STEPS` SGD steps over two micro-batches of whole groups, and the last micro-batch's
    log-probs."""
    cfg = resolved(config, world_size=1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["managed_gradient_accumulation"] = False
    torch.manual_seed(0)
    engine = build_actor(model_path, cfg, attn_impl="sdpa", lora=lora, gradient_checkpointing=checkpointing)
    rows = _rows()
    total = rows[2].sum()
    for _ in range(STEPS):
        for part in (slice(0, 6), slice(6, 9)):
            mb = tuple(x[part] for x in rows)
            logp, entropy = _logprobs(engine, mb, shared)
            loss = -(logp * mb[2]).sum() - 0.01 * (entropy * mb[2]).sum()
            engine.backward(loss / total, scale_wrt_gas=False)
        engine.step()
    return gather_state_dict(unwrap(engine)), engine


@pytest.mark.parametrize("config, lora, checkpointing", [("zero2", None, True), ("zero3", None, False),
                                                         ("zero3", LORA, True)],
                         ids=["zero2-checkpointing", "zero3", "zero3-lora-checkpointing"])
def test_shared_prompt_updates_match_padded_rows(tiny_model_path, dist_single, config, lora, checkpointing):
    padded, _ = _train(tiny_model_path, config, False, lora, checkpointing)
    shared, engine = _train(tiny_model_path, config, True, lora, checkpointing)
    assert supports_shared_prompt(engine) == ""
    worst = {name: (shared[name] - padded[name]).abs().max().item() for name in padded}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    moved = gather_state_dict(unwrap(build_actor(tiny_model_path, resolved(config, world_size=1), attn_impl="sdpa",
                                                 lora=lora)))
    assert max((shared[n] - moved[n]).abs().max().item() for n in moved if n in shared) > 1e-4  # it trained
    if lora:  # the LoRA base as reference reads the shared prompt as the padded rows do
        reference = build_shared_reference(engine)
        rows = _rows(seed=9)
        with torch.no_grad():
            a, b = _logprobs(reference, rows, False), _logprobs(reference, rows, True)
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-5


def test_llama_logprobs_match_padded_rows_and_sliding_windows_are_refused():
    """SmolLM2's architecture (Llama) reads the shared prompt as the padded rows do; a model with sliding-window
    layers is refused (its cache keeps a window, not the whole prompt)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    llama.config._attn_implementation = "sdpa"
    rows = _rows()
    with torch.no_grad():
        a, b = _logprobs(llama, rows, False), _logprobs(llama, rows, True)
    assert supports_shared_prompt(llama) == ""
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-5
    assert (a[0][rows[2] > 0] != 0).all()
    windowed = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    windowed.config._attn_implementation = "sdpa"
    assert "sliding-window" in supports_shared_prompt(windowed)
