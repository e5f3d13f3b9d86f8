"""On a CUDA machine with vLLM: a sidecar vLLM server (its own process on this GPU, float32 tiny model) synced by
`WeightSync` through each `rollout.weight_transport` — own (our CUDA-IPC buffer) and vllm (vLLM's weight_transfer
IPC engine), the latter with one server and with two sharing the trainer's buffer (`sidecar_engines=2`), and shared
(the servers' vLLM parameters are views of the trainer's buffer; one and two servers, CUDA graphs on). After three
AdamW steps the rollout is stale; after a sync the canary (every server's probe log-probs against the trainer's)
and the log-probs of a generated response match the trainer's; a sync made without waiting (`wait=False`) is
confirmed with the canary too. The disaggregated cases (2 GPUs: the trainer on GPU 0, the vLLM server on GPU 1)
sync the same way through our NCCL weight group (own) and vLLM's NCCL weight-transfer engine (vllm); skipped with
fewer GPUs. Skipped without CUDA (vLLM's IPC and NCCL engines need it). Run:
`python -m pytest tests/gpu/test_vllm_weight_transport.py -q -s` (prints each case's figures as one JSON line)."""

from __future__ import annotations

import json

import pytest
import torch

from ds_rlhf.rollout import SamplingSpec, SyncCanary, WeightSync, make_rollout_engine
from ds_rlhf.rollout.server.transports import TRANSPORTS, transport_name
from ds_rlhf.rollout.weights.canary import trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's CUDA-IPC weight transfer needs CUDA")
pytest.importorskip("vllm")

PROBE = list(range(5, 69))  # 64 fixed tokens inside the tiny vocab
BUCKET = 64 << 10  # many buckets on the tiny model, so the producer refills its buffer many times
STALE_MIN = 1e-2  # three AdamW steps at lr 1e-3 move the probe's log-probs by more (about 0.3 on CPU)


def _trainer(model_path):
    import deepspeed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine


def _train(engine, steps: int = 3, seed: int = 1234) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(5, 200, (2, 32), generator=g).to(engine.device)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def _check_sync(rollout, tiny_model_path, **case) -> None:
    """Sync, train, sync (waiting, then not): the canary and a generated response's log-probs match the trainer's."""
    try:
        trainer = _trainer(tiny_model_path)
        canary = SyncCanary(PROBE)
        sync = WeightSync(trainer, rollout, bucket_bytes=BUCKET, canary=canary)
        sync.sync()  # the trainer's starting weights
        _train(trainer)
        stale = canary.measure(trainer, rollout)["max_abs_diff"]
        info = sync.sync()
        prompt = [1, 5, 6, 7, 8]
        sample = rollout.generate([prompt], SamplingSpec(max_new_tokens=16, seed=3, ignore_eos=True))[0]
        ref = trainer_logprobs(trainer, prompt + sample.response_ids)[len(prompt) - 1:]
        gen_diff = max(abs(a - b) for a, b in zip(ref, sample.logprobs))
        _train(trainer, seed=99)
        sync.sync(wait=False)
        confirmed = sync.confirm()
        figures = {**case, "stale": stale,
                   "after": info["canary_max_abs_diff"], "gen_diff": gen_diff,
                   "after_deferred": confirmed["canary_max_abs_diff"], "buckets": info["buckets"],
                   "bytes": info["bytes"], "seconds": info["seconds"], "gbps": info["gbps"]}
        print(json.dumps(figures))
        assert info["buckets"] > 1
        assert stale > STALE_MIN
        assert info["canary_max_abs_diff"] < stale / 10 and confirmed["canary_max_abs_diff"] < stale / 10
        assert gen_diff < stale / 10
    finally:
        rollout.close()


@pytest.mark.parametrize("transport, n_engines", [("own", 1), ("vllm", 1), ("vllm", 2)])
def test_sidecar_sync_matches_the_trainer(transport, n_engines, tiny_model_path, dist_single, tmp_path):
    rollout = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), dtype="float32",
                                  max_model_len=256, gpu_memory_utilization=0.3, seed=0, weight_backend="ipc",
                                  weight_transport=transport, sidecar_engines=n_engines, enforce_eager=True,
                                  log_path=str(tmp_path / "server.log"))
    client = rollout.engines[0] if n_engines > 1 else rollout
    assert type(client.weights) is TRANSPORTS[transport_name("ipc", transport)]  # chosen once, at connect
    _check_sync(rollout, tiny_model_path, placement="sidecar", transport=transport, engines=n_engines)


@pytest.mark.parametrize("n_engines", [1, 2])
def test_sidecar_shared_weights_with_cuda_graphs(n_engines, tiny_model_path, dist_single, tmp_path):
    """`weight_transport shared`: every server's vLLM parameters are views of the trainer's CUDA buffer, bound
    while the model loads, before torch.compile and CUDA-graph capture (`enforce_eager=False`), so the captured
    graphs read what a sync writes there."""
    rollout = make_rollout_engine("vllm", "sidecar", model_path=str(tiny_model_path), dtype="float32",
                                  max_model_len=256, gpu_memory_utilization=0.3, seed=0, weight_backend="ipc",
                                  weight_transport="shared", sidecar_engines=n_engines, enforce_eager=False,
                                  log_path=str(tmp_path / "server.log"))
    clients = rollout.engines if n_engines > 1 else [rollout]
    assert type(clients[0].weights) is TRANSPORTS["shared"]
    outside = [c.stats()["server"]["shared_outside_bytes"] for c in clients]
    print(json.dumps({"transport": "shared", "engines": n_engines, "outside_bytes": outside}))
    assert outside == [0] * n_engines
    _check_sync(rollout, tiny_model_path, placement="sidecar", transport="shared", engines=n_engines,
                cuda_graphs=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="disaggregated: the trainer on GPU 0, vLLM on GPU 1")
@pytest.mark.parametrize("transport", ["own", "vllm"])
def test_disaggregated_sync_matches_the_trainer(transport, tiny_model_path, dist_single, tmp_path):
    torch.cuda.set_device(0)
    rollout = make_rollout_engine("vllm", "disaggregated", model_path=str(tiny_model_path), dtype="float32",
                                  max_model_len=256, gpu_memory_utilization=0.3, seed=0, devices=[1],
                                  weight_backend="nccl", weight_transport=transport, enforce_eager=True,
                                  log_path=str(tmp_path / "server.log"))
    assert type(rollout.weights) is TRANSPORTS[transport_name("nccl", transport)]  # chosen once, at connect
    _check_sync(rollout, tiny_model_path, placement="disaggregated", transport=transport, engines=1)
