"""Shared by the rollout tests and their multi-process workers (importable as a top-level module: pytest puts this
folder on sys.path, and the workers get it through PYTHONPATH).

Tolerance: everything runs in float32 on CPU, where vLLM's log-probs and the trainer's agree to ~5e-7 once the
weights are the same. `TOL` (1e-4) is the "they match" bound; `STALE_MIN` (1e-2) is how far apart they must be
after three AdamW steps at lr 1e-3 without a sync (observed ~0.3), so a no-op sync cannot pass.
"""

from __future__ import annotations

import os

import torch

PROBE = list(range(5, 69))  # 64 fixed tokens, well inside the tiny vocab
TOL = 1e-4
STALE_MIN = 1e-2
SMALL_BUCKET = 64 << 10  # 64 KiB: forces many buckets on the tiny model (~1.4 MB)


def run_steps(trainer, service, steps: int, start: int = 0) -> list:
    """Steps `start` .. `start + steps - 1` of a run through a rollout service: each step's batch, then an update
    published."""
    batches = []
    for step in range(start, start + steps):
        batches.append(service.batch(step))
        service.publish(trainer.step())
    return batches


def reference_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int = -1) -> torch.Tensor:
    """Exact processed log-probs of `tokens` ([T]) from the `logits` ([T, vocab]) that predicted them, as vLLM's
    `processed_logprobs` computes them: scale, top-k, then top-p on the top-k-renormalised probs (ascending sort;
    drop tokens whose cumulative mass from below is <= 1 - p; the top token always stays), log-softmax."""
    import torch.nn.functional as F

    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        xs, order = x.sort(dim=-1)
        drop = xs.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        x = x.scatter(-1, order, xs.masked_fill(drop, float("-inf")))
    return F.log_softmax(x, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def response_logits(model, sample) -> torch.Tensor:
    """[response_len, vocab] float32 logits of an HF causal LM that predicted each of `sample`'s response tokens."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float().cpu()
    return logits[len(sample.prompt_ids) - 1 : -1]


def ds_config(stage: int, micro: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "steps_per_print": 10 ** 9}


def build_engine(model_path, stage: int):
    import deepspeed
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config(stage))
    return engine


def train(engine, steps: int = 3) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator().manual_seed(1234 + rank)  # different data per rank, as in data-parallel training
    for _ in range(steps):
        x = torch.randint(5, 200, (2, 32), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()


def restore_checkpoint_weights(rollout, model_path) -> None:
    """Put the on-disk weights back into a (shared) rollout engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    rollout.weights.load(list(model.named_parameters()))


def sync_roundtrip(rollout, model_path, stage: int, bucket_bytes: int = SMALL_BUCKET) -> dict:
    """checkpoint -> DeepSpeed engine -> 3 optimizer steps -> sync; canary diffs before/after and a generated-
    response check (the log-probs vLLM returns while sampling match the trainer's after the sync).

    Every trainer rank calls this, each with its rollout engine (for a disaggregated one, ranks > 0 hold proxies)."""
    from ds_rlhf.rollout import SamplingSpec, SyncCanary, WeightSync
    from ds_rlhf.rollout.weights.canary import trainer_logprobs

    restore_checkpoint_weights(rollout, model_path)
    engine = build_engine(model_path, stage)
    canary = SyncCanary(PROBE, threshold=1e-3)
    initial = canary.measure(engine, rollout)["max_abs_diff"]
    train(engine)
    stale = canary.measure(engine, rollout)["max_abs_diff"]
    info = WeightSync(engine, rollout, bucket_bytes=bucket_bytes, canary=canary).sync()
    prompt = [1, 5, 6, 7, 8]
    s = rollout.generate([prompt], SamplingSpec(max_new_tokens=16, seed=3, ignore_eos=True))[0]
    ref = trainer_logprobs(engine, prompt + s.response_ids)[len(prompt) - 1:]
    gen_diff = max(abs(a - b) for a, b in zip(ref, s.logprobs))
    return {"initial": initial, "stale": stale, "after": info["canary_max_abs_diff"], "gen_diff": gen_diff,
            "bytes": info["bytes"], "buckets": info["buckets"], "gbps": info["gbps"],
            "max_gathered_bytes": info["max_gathered_bytes"], "engine": engine}


def skipped_sync_fires(rollout, model_path, stage: int) -> str:
    """Rollout at the checkpoint, trainer 3 steps further, no sync: the canary must raise (on every rank)."""
    from ds_rlhf.rollout import SyncCanary, SyncCanaryError

    restore_checkpoint_weights(rollout, model_path)
    engine = build_engine(model_path, stage)
    train(engine)
    try:
        SyncCanary(PROBE).check(engine, rollout)
    except SyncCanaryError as e:
        return str(e)
    raise AssertionError("the canary did not fire although the sync was skipped")


def check_generate_contract(engine, eos_id: int) -> None:
    """The RolloutEngine conventions (base.py), for any backend."""
    from ds_rlhf.rollout import SamplingSpec

    prompts = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 10]]
    spec = SamplingSpec(n=3, max_new_tokens=8, seed=11)
    samples = engine.generate(prompts, spec)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(3) for j in range(3)]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.response_ids) <= 8 and len(s.logprobs) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.finish_reason == ("stop" if s.response_ids[-1] == eos_id else "length")
        if s.finish_reason == "length":
            assert len(s.response_ids) == 8
    # reproducible with the same seed; identical prompts still get different samples (per-request seeds)
    again = engine.generate(prompts, spec)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    assert samples[0].response_ids != samples[3].response_ids
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1  # the n samples of one prompt differ
    # seeding="batch" (one seed for the call): reproducible, a different seed differs, rows still differ
    batch = SamplingSpec(n=3, max_new_tokens=8, seed=11, seeding="batch")
    first = [s.response_ids for s in engine.generate(prompts, batch)]
    engine.generate(prompts, SamplingSpec(n=3, max_new_tokens=8, seed=99, seeding="batch"))  # moves vLLM's generator
    assert [s.response_ids for s in engine.generate(prompts, batch)] == first
    other = [s.response_ids for s in engine.generate(prompts, SamplingSpec(n=3, max_new_tokens=8, seed=12,
                                                                           seeding="batch"))]
    assert other != first
    assert first[0] != first[3] and len({tuple(r) for r in first[:3]}) > 1
    # stop tokens end a response and are included in it
    greedy = engine.generate([prompts[2]], SamplingSpec(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
    stop = greedy.response_ids[2]
    stopped = engine.generate([prompts[2]], SamplingSpec(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,),
                                                         ignore_eos=True))  # stop ids still apply
    first = greedy.response_ids.index(stop)
    assert stopped[0].response_ids == greedy.response_ids[:first + 1] and stopped[0].finish_reason == "stop"
    ignored = engine.generate(prompts, SamplingSpec(max_new_tokens=8, seed=1, ignore_eos=True))
    assert all(len(s.response_ids) == 8 and s.finish_reason == "length" for s in ignored)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _init_dist() -> None:
    from ds_rlhf.distributed import ensure_distributed

    ensure_distributed()


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "engine"}


def colocated_worker(model_path: str, stages: list[int], tp: int = 1) -> dict:
    """World size N, vLLM colocated in every rank (external_launcher); per-rank prompts; sync per ZeRO stage."""
    _init_dist()
    from ds_rlhf.rollout import SamplingSpec, make_rollout_engine

    rank = _rank()
    rollout = make_rollout_engine("vllm", "colocated", model_path=model_path, dtype="float32", max_model_len=256,
                                  seed=0, tensor_parallel_size=tp)
    # Each rank asks for its own prompts (different counts too) and must get exactly its own samples back.
    prompts = [[1, 9, 10 + rank, 11 + i] for i in range(1 + rank)]
    samples = rollout.generate(prompts, SamplingSpec(n=2, max_new_tokens=6, seed=7))
    own = all(s.prompt_ids == prompts[s.prompt_index] for s in samples) and len(samples) == 2 * len(prompts)
    out = {"rank": rank, "own_samples": own, "stages": {}}
    for stage in stages:
        out["stages"][str(stage)] = _public(sync_roundtrip(rollout, model_path, stage))
    out["canary_error"] = skipped_sync_fires(rollout, model_path, stages[-1])
    rollout.close()
    return out


def disaggregated_worker(model_path: str, stages: list[int]) -> dict:
    """World size N trainer; vLLM in its own process, fed by rank 0 over a gloo weight group; every rank builds the
    engine (ranks > 0 get proxies) and asks for its own prompts."""
    _init_dist()
    from ds_rlhf.rollout import SamplingSpec, make_rollout_engine

    rank = _rank()
    rollout = make_rollout_engine("vllm", "disaggregated", model_path=model_path, dtype="float32",
                                  max_model_len=256, seed=0, bucket_bytes=SMALL_BUCKET,
                                  log_path=os.environ.get("DS_RLHF_TEST_SERVER_LOG"))
    out = {"rank": rank, "stages": {}}
    try:
        prompts = [[1, 9, 10 + rank, 11 + i] for i in range(1 + rank)]
        samples = rollout.generate(prompts, SamplingSpec(n=2, max_new_tokens=6, seed=7))
        out["own_samples"] = (all(s.prompt_ids == prompts[s.prompt_index] for s in samples)
                              and len(samples) == 2 * len(prompts))
        for stage in stages:
            out["stages"][str(stage)] = _public(sync_roundtrip(rollout, model_path, stage))
        out["canary_error"] = skipped_sync_fires(rollout, model_path, stages[-1])
        if rollout.owner:
            out["server_stats"] = {k: v for k, v in rollout.stats()["server"].items() if isinstance(v, int | float)}
    finally:
        rollout.close()
    return out


class LLMBuilt(Exception):
    """Raised by the `llm_calls` fixture's fake `vllm.LLM` once it has recorded its keyword arguments."""
