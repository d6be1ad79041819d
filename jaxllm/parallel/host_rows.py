"""A batch's rows across processes: which block of every global batch this process holds, global arrays made
from its block and read back into it, and the few quantities that must be summed over all blocks.

With `data` (or `fsdp`) across hosts each process holds one contiguous block of rows, block `index` of `count`;
with the batch replicated over an axis that crosses hosts (`stage`), processes hold the same block. A sum over
the blocks counts each block once, whichever processes hold it: the same figure on one process and on many.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec


def process_rows(sharding, global_rows: int) -> tuple[int, int]:
    """(block index, block count): this process needs rows [index * B / count, (index + 1) * B / count) of every
    global batch of `global_rows` rows placed with `sharding`, and loads only those.

    Processes whose devices hold the same rows (the batch is replicated over an axis that crosses hosts, e.g.
    `stage`) get the same block; with `data` across hosts each process gets its own.
    """
    placed = sharding.addressable_devices_indices_map((global_rows,)).values()
    blocks = {idx[0].indices(global_rows)[:2] for idx in placed}
    lo, hi = min(a for a, _ in blocks), max(b for _, b in blocks)
    size = hi - lo
    covered = sum(b - a for a, b in blocks)
    if global_rows % size or lo % size or covered < size:
        raise ValueError(f"the batch layout gives process {jax.process_index()} rows {sorted(blocks)} of "
                         f"{global_rows}, not one contiguous block: each batch axis split across hosts must come "
                         f"before those split within a host (data, fsdp, expert; config.schema.resolve_dcn checks "
                         f"a config's mesh)")
    return lo // size, global_rows // size


def row_shards(sharding: NamedSharding) -> int:
    """How many blocks `sharding` (a batch's, on a mesh or an abstract mesh) splits a batch's rows into, over
    all processes: the product of the sizes of the mesh axes its spec gives the rows."""
    entry = sharding.spec[0] if len(sharding.spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
    return math.prod(sizes[a] for a in axes)


def for_rank(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """`sharding` (a batch's, its spec naming the rows' axes first) for an array of `ndim` dimensions."""
    if len(sharding.spec) <= ndim:
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:ndim]))


def to_global(batch: dict[str, np.ndarray], sharding, global_rows: int) -> dict[str, jax.Array]:
    """This process's block of rows (numpy) -> one global jax.Array per field, split over the batch mesh axes
    (a field of fewer dimensions than the sharding's spec, as [B], takes its leading entries)."""
    return {k: jax.make_array_from_process_local_data(for_rank(sharding, np.ndim(v)), np.asarray(v),
                                                      (global_rows,) + np.shape(v)[1:])
            for k, v in batch.items()}


def to_local(arrays: dict[str, jax.Array], sharding: NamedSharding, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """Global arrays whose leading axis is a batch's rows -> this process's block of them as numpy (the inverse
    of `to_global`), after laying each out like the batch: no process reads rows it does not hold."""
    placed = _like_batch(arrays, tuple((k, for_rank(sharding, x.ndim)) for k, x in arrays.items()))
    return {k: local_rows(x, block) for k, x in placed.items()}


@functools.partial(jax.jit, static_argnums=1)
def _like_batch(arrays: dict, shardings: tuple) -> dict:
    return {k: jax.lax.with_sharding_constraint(arrays[k], s) for k, s in shardings}


def local_rows(x: jax.Array, block: tuple[int, int]) -> np.ndarray:
    """Rows [index * B / count, (index + 1) * B / count) of the global array `x` as numpy, read from this
    process's own shards only (the shards must hold them: `x` laid out like the batch, or replicated)."""
    index, count = block
    size = x.shape[0] // count
    lo, hi = index * size, (index + 1) * size
    out = np.empty((size,) + x.shape[1:], x.dtype)
    filled = np.zeros(size, bool)
    for shard in x.addressable_shards:
        start, stop, _ = shard.index[0].indices(x.shape[0]) if shard.index else (0, x.shape[0], 1)
        a, b = max(start, lo), min(stop, hi)
        if a >= b or filled[a - lo:b - lo].all():
            continue
        if any(s != slice(None) for s in shard.index[1:]):
            raise ValueError(f"local_rows: the array's shards split axes past the rows ({shard.index})")
        out[a - lo:b - lo] = np.asarray(shard.data)[a - start:b - start]
        filled[a - lo:b - lo] = True
    if not filled.all():
        raise ValueError(f"local_rows: process {jax.process_index()} holds only some of rows [{lo}, {hi}) of an "
                         f"array of {x.shape[0]} (sharding {x.sharding})")
    return out


def _each_block_once(gathered: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Gathered per-process values [P, ...] -> one per block [count, ...], in block order."""
    first = {}
    for process, index in enumerate(blocks.tolist()):
        first.setdefault(index, process)
    return gathered[[first[i] for i in sorted(first)]]


def per_block(values: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Every block's `values` (an equal-shaped array per process) [count, ...], each block once, in order; a
    collective: every process calls it at the same point."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values[None]
    gathered = np.asarray(multihost_utils.process_allgather(values))
    blocks = np.asarray(multihost_utils.process_allgather(np.int32(block[0])))
    return _each_block_once(gathered, blocks.reshape(-1))


def sum_over_blocks(values: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The sum over all blocks of each block's `values` (float64), the same on every process (a collective)."""
    return per_block(np.asarray(values, np.float64), block).sum(axis=0)


def texts_per_block(text: str, block: tuple[int, int]) -> list[str]:
    """Every block's `text` (ASCII), in block order (a collective): what each process alone holds, gathered
    where it must be written once, as a checkpoint's batch-source state."""
    data = np.frombuffer(text.encode("ascii"), np.uint8)
    lengths = per_block(np.int64(len(data)), block)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(data)] = data
    return [bytes(row[:n]).decode("ascii") for row, n in zip(per_block(padded, block), lengths)]
