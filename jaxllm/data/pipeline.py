"""Packed training/eval batches from a token store: a pure function of (seed, step).

Packing rule (exact; every other property follows from it):

* Epoch e permutes the split's documents with `np.random.default_rng([seed, e])` (identity when not
  shuffling); concatenated, they form the stream S_e of N = num_tokens tokens.
* With T = seq_len there are R = (N - 1) // T rows per epoch. Global row r lives in epoch r // R at local row
  j = r % R and covers the window W = S_e[j*T : j*T + T + 1]; tokens = W[:-1], targets = W[1:].
* segment_ids: 1-based index, within the row, of the document of each input token; positions: the token's
  offset within its document (a document carried over from the previous row keeps counting); loss_mask: 1 only
  where input and target come from the same document (the EOS of one document never predicts the next BOS).

Step s's global batch is rows [s*B, (s+1)*B); process p of P takes the contiguous slice of B/P rows. Because
no state is carried from row to row, batches do not depend on worker count, resume is just "start at step k",
and processes need no coordination.
"""
from __future__ import annotations

import collections
import os
from collections.abc import Iterator

import grain
import numpy as np

from jaxllm.data.token_store import StoreSplit, TokenStore

FIELDS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
_EPOCH_CACHE = 4  # epochs whose permutation/cumsum stay in memory (a batch spans at most two)


class PackedRows:
    """Random-access packed rows over one StoreSplit (a grain-compatible data source).

    `len()` is the rows per epoch R (what eval iterates); `__getitem__` accepts any row >= 0 and continues
    into later epochs, which is how training indexes it.
    """

    def __init__(self, split: StoreSplit, seq_len: int, seed: int = 0, shuffle: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split, self.seq_len, self.seed, self.shuffle = split, int(seq_len), int(seed), bool(shuffle)
        self.rows_per_epoch = (split.num_tokens - 1) // self.seq_len if split.num_tokens else 0
        if self.rows_per_epoch < 1:
            raise ValueError(
                f"split {split.name!r} of {split.root} has {split.num_tokens} tokens: too few for one row of "
                f"seq_len {seq_len} (needs seq_len + 1)"
            )
        self._lengths = np.diff(split.doc_offsets)
        self._epochs: collections.OrderedDict | None = None

    def __len__(self) -> int:
        return self.rows_per_epoch

    def __getitem__(self, row: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.get_rows(np.array([row])).items()}

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(perm, starts): the epoch's document order and each permuted document's start in S_e (len D+1)."""
        if self._epochs is None:
            self._epochs = collections.OrderedDict()
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        n = self.split.num_docs
        perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(self._lengths[perm], out=starts[1:])
        self._epochs[epoch] = (perm, starts)
        if len(self._epochs) > _EPOCH_CACHE:
            self._epochs.popitem(last=False)
        return perm, starts

    def get_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows (any ints >= 0) as a dict of int32 arrays [len(rows), seq_len]; one concurrent read for all."""
        rows = np.asarray(rows, np.int64)
        if rows.size and rows.min() < 0:
            raise IndexError(f"row indices must be >= 0, got {rows.min()}")
        T, R = self.seq_len, self.rows_per_epoch
        offsets = self.split.doc_offsets
        ranges, plans = [], []
        for r in rows:
            perm, starts = self.epoch_layout(int(r // R))
            lo = int(r % R) * T
            hi = lo + T + 1
            # Permuted documents overlapping [lo, hi): 'right' skips empty documents at a shared start.
            k0 = int(np.searchsorted(starts, lo, side="right")) - 1
            k1 = int(np.searchsorted(starts, hi - 1, side="right")) - 1
            pieces = []
            for k in range(k0, k1 + 1):
                a, b = max(lo, int(starts[k])), min(hi, int(starts[k + 1]))
                if a < b:
                    src = int(offsets[perm[k]]) + a - int(starts[k])
                    ranges.append((src, src + b - a))
                    pieces.append((k, a - int(starts[k]), b - a))
            plans.append(pieces)
        chunks = iter(self.split.read_many(ranges))
        out = {f: np.zeros((len(rows), T), np.int32) for f in FIELDS}
        for i, pieces in enumerate(plans):
            window = np.concatenate([next(chunks) for _ in pieces])
            doc = np.concatenate([np.full(n, k, np.int64) for k, _, n in pieces])
            pos = np.concatenate([np.arange(start, start + n, dtype=np.int32) for _, start, n in pieces])
            new_doc = np.concatenate([[0], doc[1:T] != doc[:T - 1]])
            out["tokens"][i] = window[:-1]
            out["targets"][i] = window[1:]
            out["segment_ids"][i] = 1 + np.cumsum(new_doc)
            out["positions"][i] = pos[:-1]
            out["loss_mask"][i] = doc[:-1] == doc[1:]
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_epochs"] = None  # cheap to rebuild; keeps pickles small for grain workers
        return state


class _StepBatch:
    """grain map fn: step -> this process's slice of the global batch (a picklable callable)."""

    def __init__(self, rows: PackedRows, global_batch_size: int, process_index: int, process_count: int):
        self.rows = rows
        self.global_batch_size = global_batch_size
        self.local = global_batch_size // process_count
        self.first = process_index * self.local

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        start = int(step) * self.global_batch_size + self.first
        return self.rows.get_rows(np.arange(start, start + self.local))


def _allow_worker_processes() -> None:
    # grain 0.2.18 workers read absl flags; outside absl.app they'd fail with UnparsedFlagAccessError.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class TrainIterator(grain.DatasetIterator):
    """This process's training batches for steps [step, num_steps), built by a grain pipeline.

    The checkpointable state is just the next step (plus the settings that define the data order), not
    grain's internal state: because batches are a pure function of (seed, step), a state saved with any
    num_workers or process_count restores under any other. set_state() discards prefetched batches and
    restarts the grain pipeline at the saved step.
    """

    def __init__(self, rows: PackedRows, *, global_batch_size: int, process_index: int, process_count: int,
                 start_step: int, num_steps: int, num_workers: int, prefetch: int):
        super().__init__()
        self._fn = _StepBatch(rows, global_batch_size, process_index, process_count)
        self._key = {"seed": rows.seed, "seq_len": rows.seq_len, "global_batch_size": global_batch_size}
        self._step, self._num_steps = int(start_step), int(num_steps)
        self._num_workers, self._prefetch = num_workers, prefetch
        self._inner = None

    def _ensure_inner(self):
        if self._inner is None:
            ds = grain.MapDataset.range(self._step, self._num_steps).map(self._fn)
            ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, self._prefetch),
                                                      prefetch_buffer_size=self._prefetch))
            if self._num_workers > 0:
                _allow_worker_processes()
                ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._num_workers))
            self._inner = iter(ds)
        return self._inner

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        if self._step >= self._num_steps:
            raise StopIteration
        batch = next(self._ensure_inner())
        self._step += 1
        return batch

    @property
    def step(self) -> int:
        """The step whose batch the next call to next() returns."""
        return self._step

    def get_state(self) -> dict:
        return {"step": self._step, **self._key}

    def set_state(self, state: dict) -> None:
        diff = {k: (state.get(k), v) for k, v in self._key.items() if state.get(k) != v}
        if diff:
            raise ValueError(f"data iterator state is for different settings (saved, current): {diff}")
        self._close_inner()
        self._step = int(state["step"])

    def start_prefetch(self) -> None:
        self._ensure_inner().start_prefetch()

    def _close_inner(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None

    def close(self) -> None:
        self._close_inner()
        super().close()


def make_train_iterator(
    store_path: str | os.PathLike,
    *,
    split: str = "train",
    global_batch_size: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    start_step: int = 0,
    num_steps: int,
    num_workers: int = 0,
    prefetch: int = 2,
) -> TrainIterator:
    """Iterator over this process's batches for steps start_step .. num_steps - 1.

    Each batch is a dict of int32 numpy arrays [global_batch_size // process_count, seq_len] with keys
    tokens, targets, segment_ids, positions, loss_mask. Supports get_state()/set_state() (see TrainIterator).
    """
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside [0, {process_count})")
    rows = PackedRows(TokenStore.open(store_path).split(split), seq_len, seed, shuffle=True)
    return TrainIterator(rows, global_batch_size=global_batch_size, process_index=process_index,
                         process_count=process_count, start_step=start_step, num_steps=num_steps,
                         num_workers=num_workers, prefetch=prefetch)


class EvalBatches:
    """Every row of a split once, in order, as batches; re-iterable. The last batch is padded with zero rows."""

    def __init__(self, rows: PackedRows, batch_size: int, max_batches: int | None,
                 process_index: int = 0, process_count: int = 1):
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} is not divisible by process_count {process_count}")
        self.rows, self.batch_size = rows, batch_size
        self.local = batch_size // process_count
        self.first = process_index * self.local
        n = -(-len(rows) // batch_size)
        self.num_batches = n if max_batches is None else min(n, max_batches)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for b in range(self.num_batches):
            start = b * self.batch_size + self.first
            idx = np.arange(start, start + self.local)
            real = idx[idx < len(self.rows)]
            batch = {f: np.zeros((self.local, self.rows.seq_len), np.int32) for f in FIELDS}
            if real.size:
                got = self.rows.get_rows(real)
                for f in FIELDS:
                    batch[f][:real.size] = got[f]
            yield batch


def make_eval_batches(
    store_path: str | os.PathLike,
    *,
    split: str = "eval",
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> EvalBatches:
    """Re-iterable batches covering every row of the split exactly once, unshuffled (see EvalBatches)."""
    rows = PackedRows(TokenStore.open(store_path).split(split), seq_len, seed=0, shuffle=False)
    return EvalBatches(rows, batch_size, max_batches, process_index, process_count)


def packing_efficiency(batch: dict[str, np.ndarray]) -> float:
    """Fraction of positions holding real tokens (segment_ids > 0), i.e. not padding."""
    seg = np.asarray(batch["segment_ids"])
    return float((seg > 0).mean()) if seg.size else 0.0
