"""Weight gathering for the DeepSpeed -> rollout sync (`rollout/weights/gather.py`): names vLLM's loaders
expect, tied weights once, LoRA merged, ZeRO-3 gathers in bounded buckets (not one per parameter, not all at once),
the bucket plan, the weight-group wire format and the vLLM version gate. Needs no vLLM."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import build_engine

from ds_rlhf.rollout import iter_weight_buckets
from ds_rlhf.rollout.base import RolloutError, TensorMeta
from ds_rlhf.rollout.weights import gather as weight_gather
from ds_rlhf.rollout.weights.group import pack_bucket, plan_from_wire, plan_to_wire, unpack_bucket


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)


def _flatten(buckets) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for bucket in buckets for name, t in bucket}


@pytest.mark.parametrize("raw, expected", [
    ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("model.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
])
def test_hf_names(raw, expected):
    assert weight_gather.hf_name(raw) == expected


def test_plain_module_tied_embedding_once(hf_model):
    buckets = iter_weight_buckets(hf_model, bucket_bytes=1 << 30)
    out = _flatten(buckets)
    assert "lm_head.weight" not in out and "model.embed_tokens.weight" in out  # vLLM re-ties lm_head itself
    params = dict(hf_model.named_parameters())
    assert set(out) == set(params) and all(torch.equal(out[n], params[n]) for n in out)
    assert len(buckets.plan) == 1 and [m.name for m in buckets.plan[0]] == list(out)


def test_untied_head_is_sent():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=False)
    names = set(_flatten(iter_weight_buckets(Qwen2ForCausalLM(cfg))))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= names


def test_dtype_cast_and_plan(hf_model):
    buckets = iter_weight_buckets(hf_model, bucket_bytes=64 << 10, dtype=torch.bfloat16)
    plan = buckets.plan
    seen = list(buckets)
    assert len(seen) == len(plan) > 5
    for bucket, metas in zip(seen, plan):
        assert [(n, tuple(t.shape), t.dtype) for n, t in bucket] == [(m.name, m.shape, m.dtype) for m in metas]
        assert all(t.dtype == torch.bfloat16 for _, t in bucket)
    assert buckets.bytes == sum(p.numel() * 2 for p in hf_model.parameters())


def test_lora_adapters_are_merged(tiny_model_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)  # random B: a non-zero delta to merge
    q_name = "model.layers.0.self_attn.q_proj.weight"
    unmerged_q = base.get_parameter(q_name).detach().clone()
    model = peft.get_peft_model(base, cfg)
    out = _flatten(iter_weight_buckets(model))
    assert not any("lora" in n for n in out)
    merged = dict(model.merge_and_unload().named_parameters())
    assert set(out) == set(merged), set(out) ^ set(merged)
    for name, t in out.items():
        assert torch.allclose(t, merged[name], atol=1e-6), name
    assert (out[q_name] - unmerged_q).abs().max() > 1e-3  # the adapter really changed what is sent


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_engine_buckets_are_bounded(tiny_model_path, dist_single, hf_model, monkeypatch, stage):
    calls = []
    real_gather = weight_gather._gather

    def counting_gather(params):
        calls.append(sum(p.ds_numel * p.element_size() for p in params))
        return real_gather(params)

    monkeypatch.setattr(weight_gather, "_gather", counting_gather)
    engine = build_engine(tiny_model_path, stage)
    bucket_bytes = 64 << 10
    buckets = iter_weight_buckets(engine, bucket_bytes)
    out = _flatten(buckets)
    params = dict(hf_model.named_parameters())
    assert set(out) == set(params) and all(torch.equal(out[n], params[n]) for n in out)
    if stage == 3:
        largest = max(p.ds_numel * p.element_size() for p in engine.module.parameters())
        assert buckets.zero3 and len(calls) == len(buckets.plan)
        assert 1 < len(calls) < len(params)  # bucketed: neither all at once nor one per parameter
        assert max(calls) <= max(bucket_bytes, largest)
        assert all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters())  # released again
    else:
        assert not buckets.zero3 and not calls


def test_wire_format_roundtrip():
    metas = [TensorMeta("a", (2, 3), torch.bfloat16), TensorMeta("b", (4,), torch.bfloat16)]
    tensors = [torch.randn(2, 3), torch.randn(4)]
    buf = pack_bucket(tensors, metas)
    assert buf.dtype == torch.uint8 and buf.numel() == 10 * 2
    back = dict(unpack_bucket(buf.clone(), metas))
    assert torch.equal(back["a"], tensors[0].bfloat16()) and torch.equal(back["b"], tensors[1].bfloat16())
    assert plan_from_wire(plan_to_wire([metas])) == [metas]
    with pytest.raises(RuntimeError, match="announced"):
        pack_bucket([torch.randn(3, 2), tensors[1]], metas)


def test_vllm_version_gate(monkeypatch):
    from ds_rlhf.rollout.vllm_adapter import check_vllm_version

    assert check_vllm_version("0.26.0") == (0, 26) and check_vllm_version("0.32.0+cpu") == (0, 32)
    for bad in ("0.25.2", "0.33.0", "1.0.0"):
        with pytest.raises(RolloutError, match="not a version ds_rlhf knows"):
            check_vllm_version(bad)
    monkeypatch.setenv("DS_RLHF_ALLOW_UNKNOWN_VLLM", "1")
    assert check_vllm_version("0.33.0") == (0, 33)


def test_lora_under_zero3(tiny_model_path, dist_single):
    """LoRA A/B are gathered in the same bucket as their base weight and merged on the fly."""
    peft = pytest.importorskip("peft")
    import deepspeed
    from rollout_helpers import ds_config
    from transformers import AutoModelForCausalLM

    def lora_model():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                         init_lora_weights=False))

    expected = dict(lora_model().merge_and_unload().named_parameters())
    model = lora_model()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    out = _flatten(iter_weight_buckets(engine, bucket_bytes=32 << 10))
    assert set(out) == set(expected)
    for name, t in out.items():
        assert torch.allclose(t, expected[name], atol=1e-6), name
