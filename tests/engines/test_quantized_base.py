"""model.quantize_base: a bitsandbytes 4-/8-bit frozen base under LoRA adapters (engines/quantized.py), on CPU.

Loading stores the base linears packed; the LoRA actor trains its adapters only at ZeRO-0/2; the shared-base
reference gives the quantized base's log-probs; the weight sync and the export send dequantize(base) + LoRA delta;
the schema refuses the combinations that cannot work; the memory plan counts the base at its stored size.
"""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.engines import quantized
from ds_rlhf.engines.models import load_causal_lm, merge_lora_state_dict, unwrap
from tests.engines.workers import lm_batch, resolved, train_lm

pytest.importorskip("bitsandbytes")

LORA = {"r": 8, "lora_alpha": 32}
MODES = ["nf4", "int8"]
STORAGE = {"nf4": torch.uint8, "int8": torch.int8}


def _actor(path, mode, **kw):
    return load_causal_lm(path, dtype="fp32", attn_impl="sdpa", lora=LORA, quantize=mode, **kw)


def _plain(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _quantized_plain(path, mode):
    """The base model alone, quantized the same way (no adapters): what the reference must compute."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32,
                                                 **quantized.load_kwargs(mode, torch.float32))
    return quantized.keep_standard_layout(model).eval()


def _randomize_lora_b(model, seed=0):
    """Non-zero adapters (B starts at 0), so the LoRA delta is visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_load_stores_the_base_packed(tiny_model_path, mode):
    model = _actor(tiny_model_path, mode)
    plain = dict(_plain(tiny_model_path).named_parameters())
    weights = quantized.quantized_names(model)
    linears = [n for n, p in plain.items() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    assert len(weights) == len(linears) == 14  # every decoder linear, nothing else
    full = quantized_bytes = 0
    for name, p in weights.items():
        original = plain[name.replace("base_model.model.", "").replace(".base_layer", "")]
        assert p.dtype == STORAGE[mode] and not p.requires_grad
        assert quantized.logical_shape(p) == tuple(original.shape)
        full += original.numel() * original.element_size()
        quantized_bytes += quantized.stored_bytes(p)
        out_f, in_f = original.shape
        assert quantized.stored_bytes(p) == quantized.quantized_weight_bytes(out_f, in_f, mode)  # plan's formula
        err = (quantized.dequantize(p).float() - original).norm() / original.norm()
        assert err < (0.15 if mode == "nf4" else 0.02)  # close to the original, but not equal: really quantized
        assert err > 1e-4
    # fp32 -> 4 bits is 1/8 (+ scales: ~1 KiB of code books per layer, much at this size), -> 8 bits 1/4 (+ row scales)
    assert quantized_bytes < full * (0.15 if mode == "nf4" else 0.26)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in model.named_parameters():  # adapters, embeddings, head, norms, biases stay floating point
        if not quantized.is_quantized(p):
            assert p.dtype == torch.float32, n


def test_quantized_critic_keeps_its_value_head(tiny_reward_path):
    from ds_rlhf.engines.models import CriticModel

    critic = CriticModel.from_pretrained(tiny_reward_path, "reward", dtype="fp32", attn_impl="sdpa", lora=LORA,
                                         quantize="nf4", gradient_checkpointing=True).train()
    assert len(quantized.quantized_names(critic)) == 14 and type(critic.value_head) is torch.nn.Linear
    values = critic(lm_batch(0))
    values.sum().backward()
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trained - {"value_head.weight"} and all("lora_" in n for n in trained - {"value_head.weight"})
    assert critic.value_head.weight.grad.abs().sum() > 0 and values.dtype == torch.float32


def _base_snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


@pytest.mark.parametrize("mode,stage", [("nf4", 0), pytest.param("int8", 0, marks=pytest.mark.slow),
                                        pytest.param("nf4", 2, marks=pytest.mark.slow),
                                        pytest.param("int8", 2, marks=pytest.mark.slow)])  # ~20 s each
def test_quantized_actor_trains_adapters_only(tiny_model_path, dist_single, mode, stage):
    from ds_rlhf.engines.builder import build_engine

    engine = build_engine(_actor(tiny_model_path, mode, gradient_checkpointing=True),
                          resolved("zero2", stage=stage), role="actor")
    module = unwrap(engine)
    before = _base_snapshot(module)
    batch = lm_batch(0)
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    if stage == 0:  # ZeRO-0 keeps .grad on the parameters: only adapters get one, and B's is non-zero
        with_grad = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        assert with_grad and all("lora_" in n for n in with_grad)
        assert any(g.abs().sum() > 0 for n, g in with_grad.items() if "lora_B" in n)
    engine.step()
    losses = [loss.item(), *train_lm(engine, 0, 4)]
    assert losses[-1] < losses[0] - 0.1, losses
    assert sum(p.abs().sum() for n, p in module.named_parameters() if "lora_B" in n) > 0
    for n, p in module.named_parameters():  # the packed base (and every other frozen weight) is untouched
        if n in before:
            assert torch.equal(p.detach(), before[n]), n
    assert quantized.quantized_names(module)  # still quantized after DeepSpeed's set-up and steps


def test_shared_reference_gives_the_quantized_base_logprobs(tiny_model_path, dist_single):
    from ds_rlhf.engines.builder import build_engine, build_shared_reference
    from ds_rlhf.engines.policy_forward import sequence_logprobs

    actor = build_engine(_actor(tiny_model_path, "nf4"), resolved("zero2", stage=2), role="actor")
    reference = build_shared_reference(actor)
    batch, mask = lm_batch(0), torch.ones(2, 16, dtype=torch.long)
    with torch.no_grad():
        base_q, _ = sequence_logprobs(_quantized_plain(tiny_model_path, "nf4"), batch, mask)
        base_full, _ = sequence_logprobs(_plain(tiny_model_path), batch, mask)
    assert (base_q - base_full).abs().max() > 1e-4  # quantization changes the model: the check below can fail
    train_lm(actor, 0, 3)
    actor.train()
    with torch.no_grad():
        ref_logp, _ = sequence_logprobs(reference, batch, mask)
        actor_logp, _ = sequence_logprobs(actor, batch, mask)
    torch.testing.assert_close(ref_logp, base_q, atol=1e-5, rtol=0)
    assert (actor_logp - base_q).abs().max() > 1e-3
    assert unwrap(actor).training and all(p.requires_grad for n, p in unwrap(actor).named_parameters() if "lora_" in n)


def _expected_merged(model) -> dict:
    """HF name -> dequantize(base) + scaling * B @ A for each LoRA layer, computed here from the layer's parts."""
    out = {}
    for name, sub in model.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "lora_A"):
            w = quantized.dequantize(sub.base_layer.weight).float()
            delta = (sub.lora_B["default"].weight @ sub.lora_A["default"].weight) * sub.scaling["default"]
            out[name.replace("base_model.model.", "") + ".weight"] = (w + delta).detach()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_weight_sync_sends_dequantized_base_plus_delta(tiny_model_path, mode):
    from ds_rlhf.rollout.weights.gather import iter_weight_buckets

    model = _actor(tiny_model_path, mode)
    _randomize_lora_b(model)
    with torch.no_grad():
        model(input_ids=lm_batch(0))  # bitsandbytes moves int8 scales to the layer on the first forward
    plain = _plain(tiny_model_path)
    expected = _expected_merged(model)
    assert len(expected) == 14
    buckets = iter_weight_buckets(model, 1 << 16, dtype=torch.bfloat16)
    sent = {name: t.clone() for bucket in buckets for name, t in bucket}
    tied = plain.config.tie_word_embeddings
    want = {n: p for n, p in plain.state_dict().items() if n != "lm_head.weight" or not tied}
    assert set(sent) == set(want)  # the plain checkpoint's names: no base_layer, lora_ or quant-state entries
    assert [(m.name, m.shape, m.dtype) for b in buckets.plan for m in b] == [
        (n, tuple(want[n].shape), torch.bfloat16) for n in sent]
    for name, tensor in sent.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == want[name].shape, name
    for name, value in expected.items():
        torch.testing.assert_close(sent[name].float(), value, atol=2e-2 * value.abs().max().item(), rtol=1e-2)
        torch.testing.assert_close(sent[name].float(), value.to(torch.bfloat16).float(), atol=0, rtol=0)
    # the export (merge_lora_state_dict) writes the same full-precision weights
    merged = merge_lora_state_dict(model.state_dict(), model)
    assert not [k for k in merged if "absmax" in k or "quant" in k or k.endswith("SCB") or "lora_" in k]
    for name, value in expected.items():
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0)


def test_synced_weights_compute_what_the_trainer_computes(tiny_model_path):
    """A plain model loaded with the weights vLLM would receive gives the quantized LoRA actor's logits."""
    from ds_rlhf.rollout.weights.gather import iter_weight_buckets

    model = _actor(tiny_model_path, "nf4").eval()
    _randomize_lora_b(model)
    plain = _plain(tiny_model_path)
    state = {name: t.clone() for bucket in iter_weight_buckets(model, dtype=torch.float32) for name, t in bucket}
    plain.load_state_dict(state, strict=False)
    batch = lm_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=batch).logits, model(input_ids=batch).logits, atol=1e-4, rtol=0)


# ---- the schema ----------------------------------------------------------------------------------------------------
def test_quantize_base_rules_fail_at_parse_time():
    with pytest.raises(ConfigError, match=r"model.quantize_base='nf5': choose one of none, nf4, int8"):
        parse_config(["--model.quantize_base", "nf5", "--model.lora_rank", "8"])
    with pytest.raises(ConfigError, match=r"model.quantize_base=nf4 .*--model.lora_rank"):
        parse_config(["--model.quantize_base", "nf4"])
    with pytest.raises(ConfigError, match=r"model.quantize_base=int8 needs ZeRO stage 0, 1 or 2, got --zero_stage 3"):
        parse_config(["--model.quantize_base", "int8", "--model.lora_rank", "8", "--zero_stage", "3"])
    with pytest.raises(ConfigError, match=r"got ds_config ds_configs/zero3.json \(zero_optimization.stage 3\).*"
                                          r"--zero_stage 2"):
        parse_config(["--model.quantize_base", "nf4", "--model.lora_rank", "8", "--ds_config", "ds_configs/zero3.json"])
    cfg = parse_config(["--model.quantize_base", "nf4", "--model.lora_rank", "8", "--ds_config",
                        "ds_configs/zero3.json", "--zero_stage", "2"])
    assert cfg.model.quantize_base == "nf4"
    assert parse_config([]).model.quantize_base == "none"
    with pytest.raises(ConfigError, match="zero_optimization.stage 3"):
        quantized.check_ds_config("nf4", resolved("zero3"))
    quantized.check_ds_config("nf4", resolved("zero2"))
    quantized.check_ds_config("none", resolved("zero3"))


def test_quantized_load_needs_lora(tiny_model_path):
    with pytest.raises(ValueError, match="--model.lora_rank"):
        load_causal_lm(tiny_model_path, dtype="fp32", quantize="nf4")


# ---- the memory plan -----------------------------------------------------------------------------------------------
LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("llama8b_q")
    LlamaConfig(**LLAMA8B).save_pretrained(out)
    return str(out)


def _plan(path, mode, *extra):
    from ds_rlhf.memory.plan import GiB, plan_memory

    cfg = parse_config(["--model.path", path, "--model.lora_rank", "16", "--model.dtype", "bf16", "--zero_stage",
                        "2", "--rollout.backend", "vllm", "--rl.algo", "ppo", "--rl.kl_coef", "0.05",
                        "--model.quantize_base", mode, *extra])
    plan = plan_memory(cfg, kind="rl", device="cuda", capacity=80 * GiB)
    return plan, {r.role: r for r in plan.roles}


def test_memory_plan_counts_the_base_quantized(llama8b):
    h, inter, layers = LLAMA8B["hidden_size"], LLAMA8B["intermediate_size"], LLAMA8B["num_hidden_layers"]
    kv = h // LLAMA8B["num_attention_heads"] * LLAMA8B["num_key_value_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)] * layers  # q k v o gate up down
    numel = sum(o * i for o, i in shapes)
    base, roles = _plan(llama8b, "none")
    for mode, per_param in (("nf4", (0.515, 0.518)), ("int8", (1.0, 1.001))):
        plan, q = _plan(llama8b, mode)
        stored = sum(quantized.quantized_weight_bytes(o, i, mode) for o, i in shapes)
        assert per_param[0] < stored / numel < per_param[1]
        for role in ("actor", "critic"):  # both LoRA learners load their base quantized
            assert roles[role].params - q[role].params == numel * 2 - stored, role  # bf16 -> stored size
            assert f"base {mode}" in q[role].detail
            assert (q[role].grads, q[role].optimizer_states) == (roles[role].grads, roles[role].optimizer_states)
        assert q["vllm"] == roles["vllm"]  # vLLM gets the dequantized weights in the rollout dtype
        assert q["reference"] == roles["reference"]  # a separate reference stays as it was
        assert base.phases["train"] - plan.phases["train"] == 2 * (numel * 2 - stored)
    # 8B in bf16: the actor's base linears drop from 13.0 GiB to 3.4 GiB (nf4)
    assert roles["actor"].params - _plan(llama8b, "nf4")[1]["actor"].params > 9.5 * 1024 ** 3


def test_memory_plan_fails_a_zero3_quantized_plan(llama8b):
    from ds_rlhf.memory.plan import GiB, plan_memory

    cfg = parse_config(["--model.path", llama8b, "--model.lora_rank", "16", "--model.quantize_base", "nf4",
                        "--zero_stage", "2", "--rollout.backend", "hf"])
    cfg.zero_stage = 3  # past the schema (a config edited in code)
    plan = plan_memory(cfg, kind="rl", device="cuda", capacity=141 * GiB)
    assert not plan.fits and any("FAIL: model.quantize_base=nf4 needs ZeRO stage" in n for n in plan.notes)


def test_4bit_layers_keep_the_standard_layout_after_an_eval_forward(tiny_model_path):
    """bitsandbytes would repack a 4-bit weight in place for its CPU bf16 kernel (on CPUs with AVX512-BF16) at the
    first no-grad eval forward; after `keep_standard_layout` the weight, its quant state and the dequantized
    values are what they were, on any CPU."""
    model = _quantized_plain(tiny_model_path, "nf4")
    layer = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    before = quantized.dequantize(layer.weight).clone()
    with torch.no_grad():
        model(input_ids=lm_batch(0))
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    assert layer.weight.quant_state.absmax.dtype != torch.bfloat16
    torch.testing.assert_close(quantized.dequantize(layer.weight), before, atol=0, rtol=0)

