"""On a CUDA machine with vLLM: FP8 rollouts (`rollout.quantization fp8`) on the bench shape (Qwen2 0.5B, random
init, bf16 trainer) in a sidecar vLLM server, per-tensor and per-block scales, against a bf16 engine of the same
weights. After the first sync the FP8 engine's log-probs of a fixed probe and of its own samples stay close to the
bf16 trainer's; after the trainer's weights change, a sync brings the FP8 engine to the new weights (vLLM
re-quantizes them inside its layerwise reload: an engine that kept its old FP8 weights would stay as far off as
before the sync). Prints each case's figures as one JSON line (also the engine's generation speed on the bench's
rollout shape, measured, not asserted); skipped without CUDA. Run:
`python -m pytest tests/gpu/test_fp8_rollout.py -q -s`."""

from __future__ import annotations

import json

import pytest
import torch

from ds_rlhf.rollout import SamplingSpec, SyncCanary, WeightSync, make_rollout_engine
from ds_rlhf.rollout.weights.canary import trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's FP8 kernels need CUDA")
pytest.importorskip("vllm")

# the bench shape (bench/bench_inputs.py SHAPES["0.5b"])
SHAPE = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, max_position_embeddings=4096)
PROBE = list(range(5, 69))  # 64 fixed tokens
BUCKET = 64 << 20  # several buckets: layers split over buckets must be re-quantized once the sync is complete


@pytest.fixture(scope="module")
def bench_shape_model(tmp_path_factory, tiny_model_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2-0.5b-shape")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    config = Qwen2Config(**SHAPE, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a peaked next-token distribution, as a trained model has
        model.model.embed_tokens.weight.mul_(8.0)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _perturb(model, seed: int = 7) -> None:
    """A training step's worth of change, larger than FP8 rounding: every MLP weight moved by 20% noise."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name and p.dim() == 2:
                noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
                p.add_(0.2 * p.std() * noise)


def _generation_speed(rollout, prompts: int = 256, prompt_len: int = 128, new_tokens: int = 256) -> float:
    """Generated tokens per second of the engine itself (bench/rl_step_gpu.py's rollout shape: 32 prompts x 8
    samples, 128-token prompts, 256 new tokens), after one warm-up call."""
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(5, 5000, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    spec = SamplingSpec(max_new_tokens=new_tokens, ignore_eos=True, seed=1, seeding="batch")
    rollout.generate(batch[:8], spec)
    rollout.generate(batch, spec)
    seconds, tokens = rollout.last_generate()
    return tokens / seconds


def _generated_diff(trainer, rollout) -> float:
    prompt = [1, 5, 6, 7, 8]
    sample = rollout.generate([prompt], SamplingSpec(max_new_tokens=32, seed=3, ignore_eos=True))[0]
    ref = trainer_logprobs(trainer, prompt + sample.response_ids)[len(prompt) - 1:]
    return sum(abs(a - b) for a, b in zip(ref, sample.logprobs)) / len(ref)


@pytest.mark.parametrize("quantization, scales", [("fp8", "tensor"), ("fp8", "block"), ("none", "tensor")])
def test_fp8_engine_follows_the_bf16_trainer(quantization, scales, bench_shape_model, dist_single, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(str(bench_shape_model), dtype=torch.bfloat16).cuda()
    rollout = make_rollout_engine("vllm", "sidecar", model_path=str(bench_shape_model), dtype="bf16",
                                  max_model_len=256, gpu_memory_utilization=0.3, seed=0, weight_backend="ipc",
                                  quantization=quantization, fp8_scales=scales, log_path=str(tmp_path / "server.log"))
    try:
        canary = SyncCanary(PROBE)
        sync = WeightSync(trainer, rollout, bucket_bytes=BUCKET, canary=canary)
        first = sync.sync()
        start = canary.measure(trainer, rollout)["mean_abs_diff"]
        gen_start = _generated_diff(trainer, rollout)
        _perturb(trainer)
        stale = canary.measure(trainer, rollout)["mean_abs_diff"]
        info = sync.sync()
        after = canary.measure(trainer, rollout)["mean_abs_diff"]
        gen_after = _generated_diff(trainer, rollout)
        tokens_per_s = _generation_speed(rollout)
        figures = {"quantization": quantization, "scales": scales, "device": torch.cuda.get_device_name(),
                   "probe_mean_abs_diff_first_sync": start, "generated_mean_abs_diff_first_sync": gen_start,
                   "probe_mean_abs_diff_stale": stale, "probe_mean_abs_diff_after_sync": after,
                   "generated_mean_abs_diff_after_sync": gen_after, "buckets": info["buckets"],
                   "sync_bytes": info["bytes"], "sync_seconds": info["seconds"],
                   "first_sync_seconds": first["seconds"], "generate_tokens_per_s": tokens_per_s}
        print(json.dumps(figures, default=str))
        assert info["buckets"] > 1
        assert after < stale / 3, "the sync did not bring the engine to the trainer's new weights"
        assert start < 0.25 and after < 0.25 and gen_after < 0.25, "the engine's log-probs are far off the trainer's"
    finally:
        rollout.close()
