"""The training-side data loader: sharded, deterministically shuffled, prefetched, exactly resumable.

Order: each epoch's global order is a permutation seeded by (seed, epoch) (or a length-grouped order with the
same seed), so every rank computes the same order without talking to the others. A store larger than the block
cache is shuffled in windows instead: the blocks are permuted, and rows are permuted within each window of
`shuffle_window` blocks, so each block is read once per epoch instead of once per sample (the shuffle-buffer
trade-off large-scale loaders make). Then rank r takes positions
r, r + world_size, ... so ranks never overlap and all ranks get the same number of batches (drop_last trims the
order to a multiple of world_size; otherwise it wraps around to pad). A state is just (epoch, step): restoring it
recomputes the order and continues with the exact next batch, whatever had been prefetched before the save.

Prefetch: a background thread reads the next `prefetch` batches (io_uring submissions for the blocks a batch
touches) while the trainer works on the current one; it loads the blocks of the next `readahead` batches in one
submission, so neighbouring blocks are merged into large reads.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading

import numpy as np

from ds_rlhf.errors import UserInputError

from .packing import length_grouped_order
from .store import Store, StoreMismatchError, check_store, open_store

log = logging.getLogger("ds_rlhf.data")

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Prefetcher:
    """Runs a batch generator in a daemon thread, `depth` items ahead; stop() ends it promptly."""

    def __init__(self, items, depth: int):
        self._items = items
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds_rlhf-data-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            self._put(_Failure(exc))

    def get(self):
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread died without a result") from None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class StoreLoader:
    """Iterate batches (lists of row dicts) from a store, forever (`epochs=None`) or for `epochs` epochs.

    Each `iter()` continues from the current state; `state_dict()` after receiving batch k makes a restored
    loader yield batch k+1 next. `reader_kind` says which reader serves the data ("io_uring+O_DIRECT",
    "io_uring" or "mmap"); `reader_note` says why a fallback happened.
    """

    def __init__(self, path_or_store, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True, prefetch: int = 2, reader: str = "auto",
                 epochs: int | None = None, tokenizer=None, expect_kind: str | None = None,
                 length_grouped: bool = False, as_numpy: bool = False, cache_bytes: int = 1 << 30,
                 shuffle_window: int | None = None, readahead: int = 8, indices=None):
        if isinstance(path_or_store, Store):
            self.store = path_or_store
            check_store(self.store, tokenizer, expect_kind)
        else:
            self.store = open_store(path_or_store, tokenizer, expect_kind, reader=reader, cache_bytes=cache_bytes)
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1 and 0 <= rank < world_size (got {batch_size}, {rank}, "
                             f"{world_size})")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.length_grouped, self.as_numpy = length_grouped, as_numpy
        self.prefetch, self.epochs, self.readahead = prefetch, epochs, max(1, readahead)
        block_bytes = max(1, self.store.nbytes // max(1, self.store.num_blocks))
        self._max_ahead_blocks = max(1, self.store.cache_limit // block_bytes // 2)
        if shuffle_window is None:  # global shuffle while the whole store fits in half the block cache
            shuffle_window = 0 if self.store.nbytes <= self.store.cache_limit // 2 else 64
        self.shuffle_window = shuffle_window
        self.reader_kind, self.reader_note = self.store.reader_kind, self.store.reader_note
        self.epoch = 0
        self.step = 0  # batches of the current epoch already handed out
        self._generation = 0
        self._active: set[_Prefetcher] = set()
        self._order_cache: tuple[int, np.ndarray] | None = None
        # `indices`: serve only these rows (e.g. the train part of a train/eval split); orders permute within them
        if indices is None:
            self._subset = None
            n = len(self.store)
        else:
            self._subset = np.asarray(indices, dtype=np.int64).reshape(-1)
            if self._subset.size and (self._subset.min() < 0 or self._subset.max() >= len(self.store)):
                raise ValueError(f"indices must lie in [0, {len(self.store)}) for {self.store.path}")
            n = len(self._subset)
        self.num_rows = n
        self._lengths = None
        if length_grouped:
            lengths = self.store.lengths
            self._lengths = lengths if self._subset is None else lengths[self._subset]
        per_rank = n // world_size if drop_last else -(-n // world_size)
        self.batches_per_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        if self.batches_per_epoch == 0:
            raise UserInputError(f"{self.store.path}: {n} rows give no batch of {batch_size} per rank with world "
                                 f"size {world_size} (drop_last={drop_last}); lower the batch size "
                                 "(rl.prompts_per_step for RL, optim.batch_size for SFT/RM) or add data")
        log.info("StoreLoader %s: %d rows, %d batches of %d per epoch on rank %d/%d, reader %s%s", self.store.path,
                 n, self.batches_per_epoch, batch_size, rank, world_size, self.reader_kind,
                 f" ({self.reader_note})" if self.reader_note else "")

    def __len__(self) -> int:
        return self.batches_per_epoch

    # -- order --------------------------------------------------------------------------------------------
    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's row indices for `epoch`, in the order they are served."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n, ws = self.num_rows, self.world_size
        if self.length_grouped:
            order = length_grouped_order(self._lengths, self.batch_size * ws, (self.seed, epoch))
        elif self.shuffle and self.shuffle_window:
            order = self._window_order(epoch)
        elif self.shuffle:
            order = np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
        else:
            order = np.arange(n)
        if self.drop_last:
            order = order[: (n // ws) * ws]
        else:
            order = np.resize(order, -(-n // ws) * ws)  # wraps around: every rank gets as many rows
        mine = order[self.rank::ws]
        if self._subset is not None and not (self.shuffle and self.shuffle_window and not self.length_grouped):
            mine = self._subset[mine]  # positions within the subset -> store rows (window orders are rows already)
        self._order_cache = (epoch, mine)
        return mine

    def _window_order(self, epoch: int) -> np.ndarray:
        """Store rows in window-shuffled order (restricted to `indices` when given)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, 1]))
        starts = self.store.block_starts
        blocks = rng.permutation(len(starts) - 1)
        keep = None
        if self._subset is not None:
            keep = np.zeros(len(self.store), dtype=bool)
            keep[self._subset] = True
        parts = []
        for w in range(0, len(blocks), self.shuffle_window):
            rows = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in blocks[w:w + self.shuffle_window]])
            if keep is not None:
                rows = rows[keep[rows]]
            parts.append(rng.permutation(rows))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        mine = self.epoch_indices(epoch)
        return mine[step * self.batch_size:(step + 1) * self.batch_size]

    def _batches(self, epoch: int, step: int):
        while self.epochs is None or epoch < self.epochs:
            ahead = step
            while step < self.batches_per_epoch:
                if step >= ahead:  # read the blocks of the next `readahead` batches together
                    ahead = min(self.batches_per_epoch, step + self.readahead)
                    mine = self.epoch_indices(epoch)
                    blocks = np.unique(self.store.blocks_of(mine[step * self.batch_size:ahead * self.batch_size]))
                    if len(blocks) <= self._max_ahead_blocks:
                        self.store.load_blocks(blocks)
                idx = self.batch_indices(epoch, step)
                yield epoch, step, self.store.rows(idx, as_numpy=self.as_numpy)
                step += 1
            epoch, step = epoch + 1, 0

    # -- iteration ----------------------------------------------------------------------------------------
    def _source(self):
        items = self._batches(self.epoch, self.step)
        if self.prefetch <= 0:
            return items
        p = _Prefetcher(items, self.prefetch)
        self._active.add(p)
        return p

    def _stop(self, source) -> None:
        if isinstance(source, _Prefetcher):
            source.stop()
            self._active.discard(source)

    def __iter__(self):
        gen, source = self._generation, self._source()
        try:
            while True:
                if gen != self._generation:  # load_state_dict() during iteration: restart from the new state
                    self._stop(source)
                    gen, source = self._generation, self._source()
                item = source.get() if isinstance(source, _Prefetcher) else next(source, _END)
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                epoch, step, batch = item
                self.epoch, self.step = epoch, step + 1
                if self.step >= self.batches_per_epoch:
                    self.epoch, self.step = epoch + 1, 0
                yield batch
        finally:
            self._stop(source)

    # -- checkpointing ------------------------------------------------------------------------------------
    def _config(self) -> dict:
        digest = "all" if self._subset is None else hashlib.sha1(self._subset.tobytes()).hexdigest()
        return {"num_rows": self.num_rows, "indices": digest, "batch_size": self.batch_size,
                "world_size": self.world_size, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "length_grouped": self.length_grouped, "shuffle_window": self.shuffle_window,
                "tokenizer_fingerprint": self.store.manifest["tokenizer"]["fingerprint"]}

    def state_dict(self) -> dict:
        """Position after the last batch handed out; prefetched-but-unseen batches are not counted."""
        return {"epoch": self.epoch, "step": self.step, "rank": self.rank,
                "samples_seen": (self.epoch * self.batches_per_epoch + self.step) * self.batch_size,
                **self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refuses a state from a differently configured loader (order would differ)."""
        mine = self._config()
        diff = {k: (state.get(k), v) for k, v in mine.items() if k in state and state[k] != v}
        if diff:  # a user error (StoreMismatchError): one line, no traceback
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise StoreMismatchError(f"cannot resume the data loader exactly from the checkpoint ({detail}): resume "
                                     "with the settings it was saved with (e.g. the same batch size and number of "
                                     "ranks), or start a new run")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._order_cache = None
        self._generation += 1

    def close(self) -> None:
        """Stop prefetching and close the store's files."""
        self._generation += 1
        for p in list(self._active):
            self._stop(p)
        self.store.close()
