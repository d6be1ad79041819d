"""Log-likelihoods of many token sequences in packed rows: what an evaluation harness asks a language model most.

Each request is an input sequence and the targets it predicts, of which the last few are scored (a
continuation). Requests are packed best-fit into rows of one length, each its own document (segment ids,
positions from 0), so attention never crosses from one request into another: a request's values do not depend
on what it shares a row with, nor on how many rows go into one forward pass. Rows go through the model
`rows_per_call` at a time, split over the mesh's batch axes; only two numbers per position come back to the
host (the target's log-probability and whether it is the argmax), never the logits.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxllm.model.head import chunked, token_logps
from jaxllm.model.sample import bucket
from jaxllm.train.step import batch_sharding

PACKED_ROW = 512  # the shortest row requests are packed into (rows are longer when a request is)


@dataclasses.dataclass(frozen=True)
class Scored:
    """One request: its input tokens, the targets they predict (the inputs shifted by one) and how many of the
    last targets are scored."""

    inputs: Sequence[int]
    targets: Sequence[int]
    scored: int


@dataclasses.dataclass
class _Rows:
    tokens: np.ndarray  # [N, R] int32
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    where: list[tuple[int, int]]  # request -> (row, first position of its scored targets)


def row_length(requests: Sequence[Scored], max_length: int) -> int:
    """The length of the rows `requests` are packed into: a power of two that holds the longest request, at
    least PACKED_ROW (or max_length, if shorter) so short requests share rows."""
    longest = max(len(r.inputs) for r in requests)
    return bucket(max(longest, min(max_length, PACKED_ROW)))


def pack(requests: Sequence[Scored], length: int) -> _Rows:
    """`requests` in rows of `length` tokens, best fit in decreasing length (a request goes into the fullest row
    with room for it), each request a segment of its own; filler positions have segment id 0."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].inputs))
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    fill: list[int] = []
    placed: dict[int, tuple[int, int]] = {}
    for i in order:
        n = len(requests[i].inputs)
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            row, start = len(fill), 0
            fill.append(0)
        else:
            row = free.pop(at)[1]
            start = fill[row]
        fill[row] = start + n
        placed[i] = (row, start)
        if length - fill[row] > 0:
            bisect.insort(free, (length - fill[row], row))
    rows = _Rows(*(np.zeros((len(fill), length), np.int32) for _ in range(4)), where=[])
    segments = [0] * len(fill)
    for i, request in enumerate(requests):
        row, start = placed[i]
        n = len(request.inputs)
        segments[row] += 1
        rows.tokens[row, start:start + n] = request.inputs
        rows.targets[row, start:start + n] = request.targets
        rows.segment_ids[row, start:start + n] = segments[row]
        rows.positions[row, start:start + n] = np.arange(n)
        rows.where.append((row, start + n - request.scored))
    return rows


@functools.partial(jax.jit, static_argnums=0)
def _token_stats(graphdef, params, tokens_BT, targets_BT, segment_ids_BT, positions_BT):
    """(log p(target) [B, T] float32, target is the argmax [B, T]) of a packed batch; the head runs chunk by
    chunk when the model's loss_chunk is set, as in training."""
    model = nnx.merge(graphdef, params)
    x_BTD = model.hidden_states(tokens_BT, segment_ids_BT, positions_BT)

    def stats(x_BCD, targets_BC):
        logits_BCV = model.logits(x_BCD).astype(jnp.float32)
        return token_logps(logits_BCV, targets_BC), jnp.argmax(logits_BCV, axis=-1) == targets_BC

    chunk = model.cfg.loss_chunk
    if not chunk or chunk >= tokens_BT.shape[1]:
        return stats(x_BTD, targets_BT)
    return chunked(stats, x_BTD, targets_BT, chunk)


def batch_multiple(mesh) -> int:
    """How many ways the mesh splits a batch's rows (the product of its batch axes)."""
    axes = batch_sharding(mesh).spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in axes)


def score(graphdef, params, mesh, requests: Sequence[Scored], *, max_length: int,
          rows_per_call: int) -> list[tuple[float, bool]]:
    """(summed log-likelihood of the scored targets, whether each of them is the model's argmax) per request,
    in order. `rows_per_call` is rounded up to a multiple of the mesh's batch split."""
    if not requests:
        return []
    rows = pack(requests, row_length(requests, max_length))
    multiple = batch_multiple(mesh)
    per_call = -(-rows_per_call // multiple) * multiple
    sharding = batch_sharding(mesh)
    logps, greedy = [], []
    with jax.set_mesh(mesh):
        for first in range(0, len(rows.tokens), per_call):
            batch = [_filled(a[first:first + per_call], per_call)
                     for a in (rows.tokens, rows.targets, rows.segment_ids, rows.positions)]
            out = _token_stats(graphdef, params, *(jax.device_put(a, sharding) for a in batch))
            # every process reads every row (a request's row may be on another process's devices)
            logp, best = (np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in out)
            logps.append(logp)
            greedy.append(best)
    logp, best = np.concatenate(logps), np.concatenate(greedy)
    results = []
    for request, (row, start) in zip(requests, rows.where):
        span = slice(start, start + request.scored)
        results.append((float(logp[row, span].sum()), bool(best[row, span].all())))
    return results


def _filled(block: np.ndarray, rows: int) -> np.ndarray:
    """`block` with filler rows of zeros up to `rows` rows (a call's shape stays the same: no recompiles)."""
    return np.concatenate([block, np.zeros((rows - len(block),) + block.shape[1:], block.dtype)])
