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
import sys
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from jaxllm.data.cold_cache import ChunkCache
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
        ranges, plans = self._plan(rows)
        return self._assemble(self.split.read_many(ranges), plans)

    def prefetch(self, rows: np.ndarray) -> None:
        """Start bringing these rows' tokens into the local cache of a cold store (nothing for a local one)."""
        if self.split.cold is not None:
            self.split.prefetch(self._plan(rows)[0])

    def _plan(self, rows: np.ndarray) -> tuple[list, list]:
        """(the token ranges to read, and for each row its pieces (permuted document, start in it, length))."""
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
        return ranges, plans

    def _assemble(self, read: list[np.ndarray], plans: list) -> dict[str, np.ndarray]:
        T = self.seq_len
        chunks = iter(read)
        out = {f: np.zeros((len(plans), T), np.int32) for f in FIELDS}
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


class MixtureRows:
    """Rows drawn from several PackedRows with given weights: a pure function of (seed, row).

    Global rows are grouped in blocks of `block` rows. Every block holds exactly c_i rows of source i, with
    c_i = weight_i * block rounded by largest remainder (so proportions are exact to 1/block at every block
    boundary), placed at positions given by a permutation seeded with (seed, block). Source i's k-th row
    in global order is its own row k: block b's rows of source i are b * c_i .. b * c_i + c_i - 1, in
    position order. Nothing depends on earlier rows, so workers, processes and resume behave as for one store.
    """

    def __init__(self, sources: Sequence[PackedRows], weights: Sequence[float], seed: int = 0, block: int = 4096,
                 names: Sequence[str] | None = None):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"need one weight per source, got {len(sources)} sources and {len(weights)} weights")
        w = np.asarray(weights, np.float64)
        if np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"mixture weights must be >= 0 and not all 0, got {list(weights)}")
        seq = {s.seq_len for s in sources}
        if len(seq) != 1:
            raise ValueError(f"mixture sources have different seq_len {sorted(seq)}")
        self.sources, self.seed, self.block = list(sources), int(seed), int(block)
        self.names = list(names) if names is not None else [str(i) for i in range(len(sources))]
        self.seq_len = sources[0].seq_len
        self.weights = (w / w.sum()).tolist()
        exact = np.asarray(self.weights) * block
        counts = np.floor(exact).astype(np.int64)
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:block - counts.sum()]] += 1
        self.counts = counts
        self._labels = np.repeat(np.arange(len(sources)), counts)  # unpermuted block layout
        self._cache: collections.OrderedDict | None = None

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position, that source's row index within the block) for block b."""
        if self._cache is None:
            self._cache = collections.OrderedDict()
        if b not in self._cache:
            src = self._labels[np.random.default_rng([self.seed, 0x4D49, b]).permutation(self.block)]
            rank = np.zeros(self.block, np.int64)
            for i in range(len(self.sources)):
                m = src == i
                rank[m] = np.arange(int(m.sum()))
            self._cache[b] = (src, rank)
            if len(self._cache) > _EPOCH_CACHE:
                self._cache.popitem(last=False)
        return self._cache[b]

    def assign(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, row within that source) of each global row."""
        rows = np.asarray(rows, np.int64)
        src = np.empty(len(rows), np.int64)
        local = np.empty(len(rows), np.int64)
        for b in np.unique(rows // self.block):
            m = rows // self.block == b
            s, r = self._block(int(b))
            pos = rows[m] % self.block
            src[m] = s[pos]
            local[m] = b * self.counts[s[pos]] + r[pos]
        return src, local

    def fractions(self, rows: np.ndarray) -> dict[str, float]:
        """{source name: the share of `rows` it supplies} (what a step's batch realises of the weights)."""
        src, _ = self.assign(rows)
        counts = np.bincount(src, minlength=len(self.sources))
        return {name: float(c) / max(len(src), 1) for name, c in zip(self.names, counts)}

    def prefetch(self, rows: np.ndarray) -> None:
        src, local = self.assign(rows)
        for i, source in enumerate(self.sources):
            if (src == i).any():
                source.prefetch(local[src == i])

    def get_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        src, local = self.assign(rows)
        out = {f: np.zeros((len(src), self.seq_len), np.int32) for f in FIELDS}
        for i, source in enumerate(self.sources):
            m = src == i
            if m.any():
                got = source.get_rows(local[m])
                for f in FIELDS:
                    out[f][m] = got[f]
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = None
        return state


def rows_of_step(step: int, global_batch_size: int, process_index: int, process_count: int) -> np.ndarray:
    """Global row indices of process_index's part of step's batch: a contiguous slice of B / P rows.

    Over the steps of an epoch, the processes' rows are therefore disjoint and together cover every row.
    """
    local = global_batch_size // process_count
    start = int(step) * global_batch_size + process_index * local
    return np.arange(start, start + local)


class _StepBatch:
    """grain map fn: step -> this process's slice of the global batch (a picklable callable). With a cold store,
    each call first asks the cache for the rows of the `prefetch_steps` steps after it."""

    def __init__(self, rows: PackedRows, global_batch_size: int, process_index: int, process_count: int,
                 prefetch_steps: int = 0):
        self.rows = rows
        self.global_batch_size = global_batch_size
        self.local = global_batch_size // process_count
        self.first = process_index * self.local
        self.prefetch_steps = prefetch_steps
        self._prefetched_to = -1  # the last step whose rows were asked for (each step is planned once)

    def _rows(self, step: int) -> np.ndarray:
        start = int(step) * self.global_batch_size + self.first
        return np.arange(start, start + self.local)  # == rows_of_step(...)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        ahead = range(max(step, self._prefetched_to) + 1, step + 1 + self.prefetch_steps)
        if ahead:
            self._prefetched_to = ahead[-1]
            self.rows.prefetch(np.concatenate([self._rows(s) for s in ahead]))
        return self.rows.get_rows(self._rows(step))


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
                 start_step: int, num_steps: int, num_workers: int, prefetch: int, prefetch_steps: int = 0):
        super().__init__()
        self._fn = _StepBatch(rows, global_batch_size, process_index, process_count, prefetch_steps)
        self._rows, self._global_batch_size = rows, global_batch_size
        self._key = {"seed": rows.seed, "seq_len": rows.seq_len, "global_batch_size": global_batch_size}
        if isinstance(rows, MixtureRows):  # a state must not restore into a different mixture
            self._key["mixture_weights"] = rows.weights
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

    def step_metrics(self) -> dict[str, float]:
        """Of the batch last returned: its data index (`data_index`: the step of the data order it is, which an
        audit of a resumed or elastic run checks for steps seen twice or skipped) and, of a mixture, each
        store's share of it (`data/mix/<name>`). A pure function of the step: no process reads another's rows
        to know it."""
        if self._step == 0:
            return {}
        metrics = {"data_index": self._step - 1}
        if isinstance(self._rows, MixtureRows):
            first = (self._step - 1) * self._global_batch_size
            shares = self._rows.fractions(np.arange(first, first + self._global_batch_size))
            metrics.update({f"data/mix/{name}": share for name, share in shares.items()})
        return metrics

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


def auto_num_workers(cpu_count: int | None = None, platform: str | None = None) -> int:
    """Worker processes used when num_workers is None: min(4, cpus // 4) on Linux, else 0.

    Workers pay for pickling every batch across processes; on a machine with few cores that costs more than
    it saves (2 workers measured slower than 0 on 2 cores), and the loader alone already exceeds 1M tokens/s
    in-process. `cpus` is the CPUs this process may use (sched_getaffinity), not the machine's total.
    """
    platform = sys.platform if platform is None else platform
    if cpu_count is None:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cpu_count // 4) if platform.startswith("linux") else 0


def _open_rows(store_path, split: str, seq_len: int, seed: int, cache: ChunkCache | None = None):
    """PackedRows of one store, or MixtureRows of [(store_path, weight), ...] sharing one tokenizer; read
    through `cache` when given (stores on a cold tier)."""
    if isinstance(store_path, (str, os.PathLike)):
        return PackedRows(TokenStore.open(store_path, cache).split(split), seq_len, seed, shuffle=True)
    pairs = list(store_path)
    if not pairs or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ValueError("a mixture is a list of (store_path, weight) pairs")
    stores = [TokenStore.open(p, cache) for p, _ in pairs]
    ref = stores[0].manifest
    for (path, _), st in zip(pairs, stores):
        m = st.manifest
        if (m["vocab_size"], m.get("tokenizer_sha256"), m["bos_id"], m["eos_id"]) != (
                ref["vocab_size"], ref.get("tokenizer_sha256"), ref["bos_id"], ref["eos_id"]):
            raise ValueError(f"mixture store {path} uses a different tokenizer than {pairs[0][0]}; "
                             "all stores of a mixture must be tokenized with the same model")
    sources = [PackedRows(st.split(split), seq_len, seed, shuffle=True) for st in stores]
    return MixtureRows(sources, [float(w) for _, w in pairs], seed, names=mixture_names([p for p, _ in pairs]))


def mixture_names(paths: Sequence) -> list[str]:
    """Each mixture store's name in the logs: its directory's name, numbered where two share one."""
    names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in paths]
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def make_mixture_iterator(stores: Sequence[tuple[str | os.PathLike, float]], **kwargs) -> "TrainIterator":
    """make_train_iterator over a weighted mixture of token stores (see MixtureRows)."""
    return make_train_iterator(list(stores), **kwargs)


def make_train_iterator(
    store_path: str | os.PathLike | Sequence[tuple[str | os.PathLike, float]],
    *,
    split: str = "train",
    global_batch_size: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    start_step: int = 0,
    num_steps: int,
    num_workers: int | None = None,
    prefetch: int = 2,
    cache: ChunkCache | None = None,
    prefetch_steps: int = 0,
) -> TrainIterator:
    """Iterator over this process's batches for steps start_step .. num_steps - 1.

    store_path is one token store, or a mixture: a list of (store_path, weight) pairs (see MixtureRows).
    num_workers: grain worker processes; None means auto_num_workers() (0 on a machine with < 8 CPUs).

    Each batch is a dict of int32 numpy arrays [global_batch_size // process_count, seq_len] with keys
    tokens, targets, segment_ids, positions, loss_mask. Supports get_state()/set_state() (see TrainIterator).
    `cache`: read the stores through this local cache (stores on a cold tier), fetching the rows of the next
    `prefetch_steps` steps ahead of each batch.
    """
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by process_count {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside [0, {process_count})")
    rows = _open_rows(store_path, split, seq_len, seed, cache)
    if num_workers is None:
        num_workers = auto_num_workers()
    return TrainIterator(rows, global_batch_size=global_batch_size, process_index=process_index,
                         process_count=process_count, start_step=start_step, num_steps=num_steps,
                         num_workers=num_workers, prefetch=prefetch,
                         prefetch_steps=prefetch_steps if cache is not None else 0)


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
            got = self.rows.get_rows(real if real.size else np.arange(1))  # padding rows: zeros of each field
            batch = {f: np.zeros((self.local,) + v.shape[1:], v.dtype) for f, v in got.items()}
            if real.size:
                for f, v in got.items():
                    batch[f][:real.size] = v
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
    cache: ChunkCache | None = None,
) -> EvalBatches:
    """Re-iterable batches covering every row of the split exactly once, unshuffled (see EvalBatches); read
    through `cache` when given."""
    rows = PackedRows(TokenStore.open(store_path, cache).split(split), seq_len, seed=0, shuffle=False)
    return EvalBatches(rows, batch_size, max_batches, process_index, process_count)


def packing_efficiency(batch: dict[str, np.ndarray]) -> float:
    """Fraction of positions holding real tokens (segment_ids > 0), i.e. not padding."""
    seg = np.asarray(batch["segment_ids"])
    return float((seg > 0).mean()) if seg.size else 0.0
