"""Adapter-only weight sync (`rollout.lora_sync=adapter`): vLLM (CPU, float32) started with LoRA serves the tiny
model's base from its checkpoint, and each sync sends only the LoRA actor's adapters (a peft adapter directory).

One LoRA engine for these tests (`lora_rollout`, tests/conftest.py; the session engine has no LoRA). Proven by
log-probs and greedy tokens against the trainer's own (merged) model after a few optimizer steps (non-zero B), the
bytes sent being exactly the adapters', a second sync after more steps being picked up (a new adapter version, not
vLLM's cached old one), ZeRO-3, a quantized (nf4) base being sent once at the first sync only, and the refusals
(schema at parse time, engines without LoRA, trainable base weights).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import PROBE, STALE_MIN, TOL

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout import SamplingSpec, SyncCanary, WeightSync
from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.weights.canary import trainer_logprobs

LORA = {"r": 8, "lora_alpha": 16}
PROMPT = [1, 5, 6, 7, 8]


def _lora_actor(model_path, quantize=None, stage: int = 0):
    """A DeepSpeed engine (ZeRO `stage`) around the tiny model with peft LoRA adapters (B = 0), AdamW at lr 1e-2."""
    import deepspeed

    from ds_rlhf.engines.models import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(str(model_path), dtype="fp32", attn_impl="sdpa", lora=LORA, quantize=quantize)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def _train(engine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(5, 200, (2, 32), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _adapter_bytes(engine) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) * 4 for n, p in engine.module.named_parameters()
               if ".lora_A." in n or ".lora_B." in n)


def _greedy_matches_trainer(rollout, engine) -> None:
    """vLLM's greedy tokens are the trainer's (merged model's) greedy tokens, and its log-probs the trainer's."""
    s = rollout.generate([PROMPT], SamplingSpec(max_new_tokens=16, temperature=0.0, ignore_eos=True))[0]
    ids = list(PROMPT)
    model = engine.module.eval()
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    model.train()
    assert s.response_ids == ids[len(PROMPT):]
    ref = trainer_logprobs(engine, PROMPT + s.response_ids)[len(PROMPT) - 1:]
    assert max(abs(a - b) for a, b in zip(ref, s.logprobs)) < TOL


def test_adapter_sync_serves_the_trained_adapters_and_picks_up_the_next(lora_rollout, tiny_model_path):
    engine = _lora_actor(tiny_model_path)
    canary = SyncCanary(PROBE, threshold=1e-3)
    sync = WeightSync(engine, lora_rollout, canary=canary, mode="adapter")
    try:
        assert canary.measure(engine, lora_rollout)["max_abs_diff"] < TOL  # B = 0: the actor is the base
        _train(engine, 3, seed=1)
        assert max(p.abs().max().item() for n, p in engine.module.named_parameters() if "lora_B" in n) > 0
        assert canary.measure(engine, lora_rollout)["max_abs_diff"] > STALE_MIN  # trained, not yet synced
        info = sync.sync()
        assert info["canary_max_abs_diff"] < TOL and info["mode"] == "adapter"
        assert info["bytes"] == info["adapter_bytes"] == _adapter_bytes(engine) and info["base_bytes"] == 0
        merged = sum(p.numel() * 4 for p in engine.module.get_base_model().parameters())  # tied weights once
        assert info["bytes"] < merged / 5
        _greedy_matches_trainer(lora_rollout, engine)
        _train(engine, 2, seed=2)
        assert canary.measure(engine, lora_rollout)["max_abs_diff"] > STALE_MIN  # vLLM still on version 1
        info = sync.sync()
        assert info["adapter_version"] == 2 and info["canary_max_abs_diff"] < TOL
        _greedy_matches_trainer(lora_rollout, engine)
        assert [p.name for p in sync._dirs.root.iterdir()] == ["v000002"]  # the old version is removed
        assert lora_rollout.stats()["adapter_id"] == info["adapter_id"]
    finally:
        sync.close()


def test_adapter_sync_at_zero3_into_a_given_directory(lora_rollout, tiny_model_path, tmp_path):
    """ZeRO-3 partitions the adapters too: they are gathered for the sync; a given directory gets a per-rank folder
    holding the peft adapter (safetensors + config)."""
    engine = _lora_actor(tiny_model_path, stage=3)
    sync = WeightSync(engine, lora_rollout, canary=SyncCanary(PROBE, threshold=1e-3), mode="adapter",
                      adapter_dir=str(tmp_path))
    _train(engine, 2, seed=5)
    info = sync.sync()
    assert info["zero3"] and info["canary_max_abs_diff"] < TOL and info["bytes"] == _adapter_bytes(engine)
    written = tmp_path / "rank0" / "v000001"
    assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_quantized_base_is_sent_once(lora_rollout, tiny_model_path):
    """An nf4 base differs from the checkpoint vLLM loaded: the first sync sends it (dequantized, unmerged), the
    next ones the adapters only; vLLM then computes what the quantized trainer computes."""
    pytest.importorskip("bitsandbytes")
    from rollout_helpers import restore_checkpoint_weights

    engine = _lora_actor(tiny_model_path, quantize="nf4")
    canary = SyncCanary(PROBE, threshold=1e-3)
    adapters_only = WeightSync(engine, lora_rollout, mode="adapter", send_base=False)
    sync = WeightSync(engine, lora_rollout, canary=canary, mode="adapter")  # send_base None: sent, being nf4
    try:
        _train(engine, 2, seed=3)
        adapters_only.sync(check=False)
        assert canary.measure(engine, lora_rollout)["max_abs_diff"] > STALE_MIN  # the checkpoint's base is not nf4's
        first = sync.sync()
        assert first["base_bytes"] > 10 * first["adapter_bytes"] > 0 and first["canary_max_abs_diff"] < TOL
        _train(engine, 2, seed=4)
        second = sync.sync()
        assert second["base_bytes"] == 0 and second["bytes"] == second["adapter_bytes"]
        assert second["canary_max_abs_diff"] < TOL
    finally:
        adapters_only.close()
        sync.close()
        restore_checkpoint_weights(lora_rollout, tiny_model_path)  # the module's engine serves the checkpoint again


def test_trainable_base_weights_are_refused(lora_rollout, tiny_model_path):
    engine = _lora_actor(tiny_model_path)
    engine.module.get_base_model().model.norm.weight.requires_grad_(True)
    with pytest.raises(RolloutError, match="other weights train .*model.norm.weight.*lora_sync=merged"):
        WeightSync(engine, lora_rollout, mode="adapter").sync(check=False)


def test_engines_without_lora_are_refused(tiny_model_path):
    from ds_rlhf.rollout import make_rollout_engine
    from ds_rlhf.rollout.hf_engine import HFRolloutEngine

    with pytest.raises(ValueError, match="needs the colocated vLLM engine, got backend='hf'"):
        make_rollout_engine("hf", "colocated", model_path=str(tiny_model_path), lora={"rank": 8})
    hf = HFRolloutEngine(str(tiny_model_path))
    with pytest.raises(RolloutError, match="needs a rollout engine started with LoRA"):
        WeightSync(torch.nn.Linear(2, 2), hf, mode="adapter")
    with pytest.raises(RolloutError, match="has no LoRA adapter support"):
        hf.weights.load_adapter("/nonexistent")


def test_lora_rank_rounds_up_to_a_vllm_max_lora_rank():
    pytest.importorskip("vllm")
    from ds_rlhf.rollout.vllm_adapter import lora_engine_kwargs

    assert lora_engine_kwargs(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert lora_engine_kwargs(16)["max_lora_rank"] == 16
    with pytest.raises(RolloutError, match="above vLLM's largest max_lora_rank"):
        lora_engine_kwargs(4096)


OK = ["--model.lora_rank", "8", "--rollout.backend", "vllm", "--rollout.sleep_level", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--rollout.lora_sync", "adapter", "--rollout.sleep_level", "1"], "model.lora_rank=0 trains the whole model"),
    (["--rollout.lora_sync", "adapter", "--model.lora_rank", "8", "--rollout.backend", "hf",
      "--rollout.sleep_level", "1"], "rollout.backend=hf, rollout.placement=colocated"),
    ([*OK, "--rollout.lora_sync", "adapter", "--rollout.placement", "disaggregated"], "placement=disaggregated"),
    (["--model.lora_rank", "8", "--rollout.lora_sync", "adapter"], "rollout.sleep_level=2"),
    (["--rollout.lora_sync", "lora"], "rollout.lora_sync='lora': choose one of auto, merged, adapter"),
])
def test_schema_refuses_adapter_sync_where_it_cannot_work(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as e:
        parse_config(argv)
    assert "\n" not in str(e.value) and "lora_sync" in str(e.value)


def test_schema_accepts_adapter_sync_and_auto_stays_merged():
    assert parse_config([*OK, "--rollout.lora_sync", "adapter"]).rollout.sync_mode() == "adapter"
    assert parse_config(["--model.lora_rank", "8", "--rollout.sleep", "false", "--rollout.lora_sync",
                         "adapter"]).rollout.sync_mode() == "adapter"
    assert parse_config(["--model.lora_rank", "8"]).rollout.sync_mode() == "merged"  # auto
    assert parse_config([]).rollout.lora_sync == "auto"
