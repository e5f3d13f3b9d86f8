"""Rollout engines stop at every stop id of a chat model (`rollout.stops.stop_token_ids`), keep the stop token as
the response's last token (its log-prob too) and nothing after it; a response cut by max_new_tokens has none."""

from __future__ import annotations

import json
import shutil

import pytest

from ds_rlhf.rollout import SamplingSpec, make_rollout_engine
from ds_rlhf.rollout.stops import stop_token_ids

PROMPT = [1, 5, 6, 7]
EOS = 2  # the tiny model's <|im_end|>


def second_new_token(engine) -> tuple[list[int], int]:
    """(greedy response without stops, index k of its first token, after the first, not seen before it)."""
    greedy = engine.generate([PROMPT], SamplingSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    ids = greedy.response_ids
    k = next((k for k in range(1, len(ids)) if ids[k] not in ids[:k] and ids[k] != EOS), None)
    assert k is not None, f"the tiny model's greedy response {ids} has no new token after its first"
    return ids, k


def unused_id(ids: list[int]) -> int:
    return next(t for t in range(10, 400) if t not in ids)


def check_stops_at_second_id(engine, tokenizer, model_dir) -> None:
    """Stop ids from a generation config listing [unused id, the greedy path's k-th token]: the engine stops at
    the second id, keeps it last, with its log-prob; one token fewer budget gives a truncated response."""
    ids, k = second_new_token(engine)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [unused_id(ids), ids[k]]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    stops = stop_token_ids(tokenizer, model_dir)
    assert stops == (tokenizer.eos_token_id, unused_id(ids), ids[k])  # the template's end-of-turn is the EOS
    spec = SamplingSpec(max_new_tokens=8, temperature=0.0, stop_token_ids=stops)
    out = engine.generate([PROMPT], spec)[0]
    assert out.response_ids == ids[:k + 1] and out.finish_reason == "stop"
    assert len(out.logprobs) == k + 1
    cut = engine.generate([PROMPT], SamplingSpec(max_new_tokens=k, temperature=0.0, stop_token_ids=stops))[0]
    assert cut.response_ids == ids[:k] and cut.finish_reason == "length"
    assert not set(cut.response_ids) & set(stops)


def check_nothing_after_a_stop(engine) -> None:
    """Sampled responses with frequent stop ids: a stop id is only ever the last token, and ends as "stop"."""
    prompts = [PROMPT, [1, 9, 10], [1, 2, 3, 4, 5, 6]]
    free = engine.generate(prompts, SamplingSpec(n=4, max_new_tokens=12, seed=3, ignore_eos=True))
    counts = {}
    for s in free:
        for t in s.response_ids:
            counts[t] = counts.get(t, 0) + 1
    stops = tuple(sorted(counts, key=counts.get, reverse=True)[:2])
    out = engine.generate(prompts, SamplingSpec(n=4, max_new_tokens=12, seed=3, stop_token_ids=stops))
    ends = set(stops) | {EOS}  # the model's EOS stops too
    stopped = 0
    for s in out:
        assert not set(s.response_ids[:-1]) & ends, (s.response_ids, stops)
        assert s.finish_reason == ("stop" if s.response_ids[-1] in ends else "length")
        assert len(s.logprobs) == len(s.response_ids)
        stopped += s.response_ids[-1] in stops
    assert stopped > 0


@pytest.fixture
def model_dir(tiny_model_path, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_path, out)
    return out


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_path):
    engine = make_rollout_engine("hf", model_path=str(tiny_model_path), dtype="float32", batch_size=4)
    yield engine
    engine.close()


def test_hf_engine_stops_at_a_second_stop_id(hf_rollout, tiny_tokenizer, model_dir):
    check_stops_at_second_id(hf_rollout, tiny_tokenizer, model_dir)


def test_hf_engine_keeps_nothing_after_a_stop(hf_rollout):
    check_nothing_after_a_stop(hf_rollout)


def test_hf_engine_stops_at_every_generation_config_eos(hf_rollout, model_dir):
    """Without stop ids in the spec, the HF engine still stops at each id of its model's eos_token_id list."""
    ids, k = second_new_token(hf_rollout)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [unused_id(ids), ids[k]]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    engine = make_rollout_engine("hf", model_path=str(model_dir), dtype="float32", batch_size=4)
    try:
        out = engine.generate([PROMPT], SamplingSpec(max_new_tokens=8, temperature=0.0))[0]
        ignored = engine.generate([PROMPT], SamplingSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    finally:
        engine.close()
    assert out.response_ids == ids[:k + 1] and out.finish_reason == "stop"
    assert ignored.response_ids == ids and ignored.finish_reason == "length"


def test_vllm_stops_at_a_second_stop_id(vllm_rollout, tiny_tokenizer, model_dir):
    check_stops_at_second_id(vllm_rollout, tiny_tokenizer, model_dir)


def test_vllm_keeps_nothing_after_a_stop(vllm_rollout):
    check_nothing_after_a_stop(vllm_rollout)
