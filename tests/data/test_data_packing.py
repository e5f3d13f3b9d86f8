"""Padding-free packing, token-budget micro-batches, length-grouped order; and the addition-task stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_rlhf.data import (
    StoreLoader,
    length_grouped_order,
    open_store,
    pack_sequences,
    packed_attention_mask,
    token_budget_microbatches,
    unpack_sequences,
)
from ds_rlhf.data.packing import microbatch_rows


def test_pack_sequences_layout():
    seqs = [[5, 6, 7], np.array([8]), torch.tensor([9, 10])]
    out = pack_sequences(seqs, extras={"loss_mask": [[0, 1, 1], [1], torch.tensor([0, 1], dtype=torch.int8)]})
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]] and out["input_ids"].dtype == torch.int64
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert out["cu_seqlens"].tolist() == [0, 3, 4, 6] and out["cu_seqlens"].dtype == torch.int32
    assert out["max_seqlen"] == 3 and out["seq_lens"] == [3, 1, 2]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 1]]
    assert [t.tolist() for t in unpack_sequences(out["input_ids"], out["cu_seqlens"])] == [[5, 6, 7], [8], [9, 10]]
    with pytest.raises(ValueError, match="empty"):
        pack_sequences([[1], []])
    with pytest.raises(ValueError, match="values for a"):
        pack_sequences([[1, 2]], extras={"m": [[1]]})


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_forward_matches_per_sequence_forward(tiny_model_path, impl):
    """Packed row + position_ids + block-diagonal mask gives the same logits as separate forwards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=impl).eval()
    seqs = [[1, 20, 30, 40, 2], [1, 50, 60], [1, 70, 80, 90]]
    packed = pack_sequences(seqs)
    mask = packed_attention_mask(packed["cu_seqlens"])
    assert mask.shape == (1, 1, 12, 12) and mask[0, 0, 5, 4] < 0 and mask[0, 0, 6, 5] == 0
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       attention_mask=mask).logits
        ref = [model(input_ids=torch.tensor([s])).logits[0] for s in seqs]
    for got, want in zip(unpack_sequences(logits, packed["cu_seqlens"]), ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("sort", [True, False])
def test_token_budget_microbatches_respect_the_budget(padded, sort):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 200).tolist() + [1000]  # one sequence over the budget
    mbs = token_budget_microbatches(lengths, 512, padded=padded, sort=sort)
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))  # every index exactly once, nothing split
    for mb in mbs:
        cost = max(lengths[i] for i in mb) * len(mb) if padded else sum(lengths[i] for i in mb)
        assert cost <= 512 or mb == [200]
    assert [200] in mbs
    if sort and not padded:  # first-fit decreasing packs close to the lower bound
        assert len(mbs) <= int(np.ceil(sum(lengths[:-1]) / 512)) + 2
    if not sort:  # order-preserving greedy: micro-batches are consecutive runs
        assert sum(mbs, []) == list(range(len(lengths)))


def test_min_microbatches_splits_for_rank_agreement():
    mbs = token_budget_microbatches([10, 10, 10, 10], 100, min_microbatches=3)
    assert len(mbs) == 3 and sorted(sum(mbs, [])) == [0, 1, 2, 3]
    assert token_budget_microbatches([10], 100, min_microbatches=2) == [[0], []]


def test_length_grouped_order():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1000, 1000)
    order = length_grouped_order(lengths, 16, seed=(3, 0))
    assert sorted(order.tolist()) == list(range(1000))
    assert (order == length_grouped_order(lengths, 16, seed=(3, 0))).all()
    assert not (order == length_grouped_order(lengths, 16, seed=(3, 1))).all()
    assert lengths[order[:16]].max() == lengths.max()  # longest group first
    spread = np.mean([np.ptp(lengths[order[i:i + 16]]) for i in range(0, 992, 16)])
    rand = np.mean([np.ptp(lengths[i:i + 16]) for i in range(0, 992, 16)])
    assert spread < 0.2 * rand


def test_addition_stores_feed_loader_and_packing(tmp_path, tok, tiny_model_path):
    from ds_rlhf.data.synthetic import write_addition_datasets
    from ds_rlhf.tasks.addition import prompt_rows

    stores = write_addition_datasets(tmp_path, tiny_model_path, n_prompts=40, n_sft=30, n_pref=20, seed=0)
    assert set(stores) == {"prompts", "sft", "preference"}
    for kind, path in stores.items():
        with open_store(path, tok, kind) as store:
            assert len(store) == {"prompts": 40, "sft": 30, "preference": 20}[kind]
    prompts = open_store(stores["prompts"], tok, "prompts")
    assert prompts.column("ground_truth").to_pylist() == [r["label"] for r in prompt_rows(40, 0)]
    assert set(prompts.column("data_source").to_pylist()) == {"addition"}
    mtime = (stores["sft"] / "manifest.json").stat().st_mtime_ns
    write_addition_datasets(tmp_path, tiny_model_path, n_prompts=40, n_sft=30, n_pref=20, seed=0)
    assert (stores["sft"] / "manifest.json").stat().st_mtime_ns == mtime  # unchanged inputs: store reused
    batch = next(iter(StoreLoader(stores["sft"], batch_size=8, tokenizer=tok, expect_kind="sft")))
    micro = microbatch_rows(batch, max_tokens=100)
    assert sorted(i for mb in micro for i in mb["indices"]) == list(range(8))
    for mb in micro:
        assert mb["input_ids"].shape == mb["loss_mask"].shape and mb["input_ids"].shape[1] <= 100
        assert int(mb["loss_mask"].sum()) > 0
