"""StoreLoader: resume exactness (both readers, with and without the prefetch thread), sharding, shuffling."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from datahelp import needs_uring, synthetic_rows

from ds_rlhf.data import StoreLoader, open_store
from ds_rlhf.data.writer import write_store


def _ids(batches) -> list[list[int]]:
    return [[r["index"] for r in b] for b in batches]


def _take(loader, n):
    return list(itertools.islice(iter(loader), n))


@pytest.mark.parametrize("reader,prefetch", [
    pytest.param("uring", 2, marks=needs_uring), pytest.param("uring", 0, marks=needs_uring), ("mmap", 3)])
def test_resume_continues_with_the_exact_next_sample(sft_store, reader, prefetch):
    """Stop mid-epoch 1 (after 50 batches, 23 per epoch), restore into a fresh loader, compare with no stop."""
    kw = dict(batch_size=13, seed=7, reader=reader, prefetch=prefetch)
    full = StoreLoader(sft_store, **kw)
    assert full.reader_kind == ("io_uring+O_DIRECT" if reader == "uring" else "mmap")
    expected = _take(full, 80)

    first = StoreLoader(sft_store, **kw)
    it = iter(first)
    head = [next(it) for _ in range(50)]  # the prefetch thread has already read ahead past batch 50
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (2, 4) and state["samples_seen"] == 50 * 13
    it.close()
    first.close()

    resumed = StoreLoader(sft_store, **kw)
    resumed.load_state_dict(state)
    tail = _take(resumed, 30)
    assert _ids(head + tail) == _ids(expected)
    for got, want in zip(tail, expected[50:]):
        assert [r["input_ids"] for r in got] == [r["input_ids"] for r in want]


def test_resume_at_epoch_boundary_and_across_readers(sft_store):
    a = StoreLoader(sft_store, batch_size=10, seed=3, reader="mmap")
    expected = _take(a, 40)  # 30 batches per epoch
    b = StoreLoader(sft_store, batch_size=10, seed=3, reader="mmap")
    _take(b, 30)
    assert (b.state_dict()["epoch"], b.state_dict()["step"]) == (1, 0)
    c = StoreLoader(sft_store, batch_size=10, seed=3)  # a store read through another reader resumes the same
    c.load_state_dict(b.state_dict())
    assert _ids(_take(c, 10)) == _ids(expected[30:])


def test_load_state_dict_while_iterating_restarts_from_it(sft_store):
    ref = _ids(_take(StoreLoader(sft_store, batch_size=8, seed=1), 12))
    loader = StoreLoader(sft_store, batch_size=8, seed=1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = loader.state_dict()
    for _ in range(5):
        next(it)
    loader.load_state_dict(saved)
    assert _ids([next(it) for _ in range(4)]) == ref[3:7]


def test_shuffle_is_deterministic_per_seed_and_epoch(sft_store):
    a = StoreLoader(sft_store, batch_size=10, seed=5, epochs=2, prefetch=0)
    b = StoreLoader(sft_store, batch_size=10, seed=5, epochs=2)
    ea, eb = _ids(list(a)), _ids(list(b))
    assert ea == eb and len(ea) == 60  # `epochs` ends iteration
    epoch0, epoch1 = sum(ea[:30], []), sum(ea[30:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(300)) and epoch0 != epoch1
    other = _ids(_take(StoreLoader(sft_store, batch_size=10, seed=6), 30))
    assert sum(other, []) != epoch0
    plain = _ids(_take(StoreLoader(sft_store, batch_size=10, shuffle=False), 3))
    assert plain == [list(range(i * 10, i * 10 + 10)) for i in range(3)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_sharding_by_rank(tmp_path, drop_last):
    path = write_store(tmp_path / "s", "sft", synthetic_rows(103), block_rows=16)
    per_rank = []
    for rank in range(4):
        loader = StoreLoader(path, batch_size=5, rank=rank, world_size=4, seed=2, drop_last=drop_last, epochs=1)
        per_rank.append(_ids(list(loader)))
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of steps
    seen = [i for batches in per_rank for b in batches for i in b]
    if drop_last:
        assert len(per_rank[0]) == 103 // 4 // 5 and len(seen) == len(set(seen))  # disjoint
    else:
        assert len(per_rank[0]) == 6 and set(seen) == set(range(103))  # covers all, padded by wrap-around
        assert [len(b) for b in per_rank[0]][-1] == 26 - 25


def test_length_grouped_batches_hold_similar_lengths(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"input_ids": [1] * int(n), "loss_mask": [1] * int(n), "row_id": i, "source_idx": 0}
            for i, n in enumerate(rng.integers(1, 500, 400))]
    path = write_store(tmp_path / "s", "sft", rows)
    lengths = open_store(path).lengths

    def spread(loader):
        return np.mean([np.ptp([lengths[r["index"]] for r in b]) for b in _take(loader, 20)])

    grouped = StoreLoader(path, batch_size=8, world_size=2, rank=1, length_grouped=True, seed=0)
    assert spread(grouped) < 0.25 * spread(StoreLoader(path, batch_size=8, seed=0))
    again = StoreLoader(path, batch_size=8, world_size=2, rank=1, length_grouped=True, seed=0)
    again.load_state_dict(grouped.state_dict())
    assert _ids(_take(again, 5)) == _ids(_take(grouped, 5))


def test_bad_configurations_are_refused(sft_store):
    loader = StoreLoader(sft_store, batch_size=10, seed=1)
    with pytest.raises(ValueError, match="batch_size: saved 10 vs now 20"):
        StoreLoader(sft_store, batch_size=20, seed=1).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="no batch"):
        StoreLoader(sft_store, batch_size=400)
    with pytest.raises(ValueError):
        StoreLoader(sft_store, batch_size=4, rank=2, world_size=2)


def test_reader_errors_surface_in_the_consumer(sft_store):
    loader = StoreLoader(sft_store, batch_size=10, prefetch=2)

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    loader.store.load_blocks = boom
    with pytest.raises(OSError, match="Input/output"):
        next(iter(loader))


def test_window_shuffle_for_stores_larger_than_the_cache(sft_store):
    """Block-window shuffle: still a deterministic permutation per epoch, exactly resumable, reads blocks once."""
    small = open_store(sft_store, cache_bytes=1)  # "larger than the cache": auto picks the window shuffle
    loader = StoreLoader(small, batch_size=10, seed=4, epochs=2)
    assert loader.shuffle_window == 64
    kw = dict(batch_size=10, seed=4, shuffle_window=3)
    a = _ids(list(StoreLoader(sft_store, epochs=2, **kw)))
    assert sorted(sum(a[:30], [])) == list(range(300)) and sum(a[:30], []) != sum(a[30:], [])
    starts = open_store(sft_store).block_starts
    first_window = sum(a[:2], [])  # 20 rows drawn from the first window of 3 blocks
    assert len(set(np.searchsorted(starts, first_window, side="right") - 1)) <= 3
    b = StoreLoader(sft_store, **kw)
    _take(b, 17)
    c = StoreLoader(sft_store, **kw)
    c.load_state_dict(b.state_dict())
    assert _ids(_take(c, 20)) == a[17:37]
    with pytest.raises(ValueError, match="shuffle_window"):
        StoreLoader(sft_store, batch_size=10, seed=4).load_state_dict(b.state_dict())


@pytest.mark.parametrize("window", [0, 4])
def test_index_subset_for_train_eval_splits(sft_store, window):
    subset = list(range(0, 300, 3))  # e.g. the train part of a split
    kw = dict(batch_size=10, seed=2, shuffle_window=window, indices=subset)
    a = StoreLoader(sft_store, epochs=2, **kw)
    assert len(a) == 10 and a.num_rows == 100
    epochs = _ids(list(a))
    assert sorted(sum(epochs[:10], [])) == subset and sorted(sum(epochs[10:], [])) == subset
    b = StoreLoader(sft_store, **kw)
    _take(b, 13)
    c = StoreLoader(sft_store, **kw)
    c.load_state_dict(b.state_dict())
    assert _ids(_take(c, 5)) == epochs[13:18]
    with pytest.raises(ValueError, match="indices"):
        StoreLoader(sft_store, batch_size=10, seed=2, shuffle_window=window,
                    indices=subset[1:] + [1]).load_state_dict(b.state_dict())


def test_prefetch_thread_stops_when_iteration_stops(sft_store):
    import threading

    def prefetchers():
        return [t for t in threading.enumerate() if t.name == "ds_rlhf-data-prefetch"]

    loader = StoreLoader(sft_store, batch_size=10, prefetch=3)
    for i, _ in enumerate(loader):
        if i == 4:
            break  # the for loop drops the generator: its finally stops the thread
    assert not prefetchers()
    it = iter(loader)
    next(it)
    assert prefetchers()
    loader.close()
    assert not prefetchers()
