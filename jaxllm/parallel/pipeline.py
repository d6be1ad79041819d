"""Pipeline parallelism over the `stage` mesh axis: GPipe (repeats=1) and circular (repeats>1) schedules, SPMD,
as a forward scan that autodiff reverses (the explicit 1F1B-family schedules: jaxllm/parallel/scheduled.py, which
shares the chunk layout below).

Letters: p stages, m micro-batches, r repeats, L layers, Lc = L/(p*r) layers per chunk (one stage, one repeat).

Layer l of the stack belongs to chunk c = l // Lc; chunk c runs on stage s = c % p in repeat j = c // p, so a
micro-batch visits stages 0..p-1 with chunks 0..p-1, then goes round the ring again for chunks p..2p-1, and so on.
Parameters stay stored [L, ...] in layer order. With the stored `layers` axis split over `stage` in contiguous
blocks (RULES['layers'] = ('stage', None)), device s holds layers [s*L/p, (s+1)*L/p):
  r = 1: exactly its GPipe stage; nothing moves.
  r > 1: it holds chunks s*r .. s*r + r-1 but runs chunks s, p+s, 2p+s, ...; `circular_rounds` moves them with r
         collective-permutes of one chunk each (forward; their transposes in backward): per step each device
         sends and receives its own L/p layers, and never holds more than 2x its share. Storing layers in
         circular order would make this free, but would tie checkpoints to (p, r).

The whole loop runs inside one `jax.shard_map` that is manual over `stage` only (data/fsdp/tensor stay Auto,
so the layers' own sharding constraints keep working). Per device: its stage's weights [r, Lc, ...], the running
activation `state` of the micro-batch it is working on, and a buffer [m, B/m, T, D] that on stage 0 holds each
micro-batch's latest activation (the inputs at first, then what comes back round the ring, finally the outputs).
`lax.scan` runs m*r + p - 1 iterations; at iteration t stage s works on virtual micro-batch k = t - s (micro-batch
k % m in repeat k // m) when 0 <= k < m*r, else it idles (a bubble). After each iteration the activations move one
stage on with `lax.ppermute` (a collective-permute); stage 0 files what it receives from stage p-1 into the buffer.

Bubbles never touch results: a bubble's input is replaced by zeros before the layers see it (so even NaN garbage
cannot reach a gradient through 0 * NaN), and its output is never written anywhere. `debug_nan_bubbles=True`
feeds NaN into every bubble to prove it. The per-iteration stage body is wrapped in `jax.checkpoint`, so the
backward pass keeps only each iteration's input activation; the model's own remat policy applies inside.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.context import CONTEXT
from jaxllm.parallel.sharding import active_mesh, constrain

STAGE = "stage"


def num_stages(mesh=None) -> int:
    """Size of the `stage` axis of `mesh` (default: the active mesh); 1 when there is none."""
    mesh = active_mesh() if mesh is None else mesh
    if mesh is None or STAGE not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[STAGE]


def _promoted(collective, x):
    """`collective(x)`, a sum over `stage` (or the cast whose transpose is one), run in float32 for a 16-bit `x` on
    XLA:CPU, as that backend sums anyway: its own promotion of a bfloat16 all-reduce (AllReducePromotion) aborts
    on the reducer jax writes inside a mesh ("Invalid binary instruction opcode copy")."""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or jax.default_backend() != "cpu":
        return collective(x)
    return collective(x.astype(jnp.float32)).astype(x.dtype)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Theoretical idle fraction of the schedule: (p-1) / (r*m + p-1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def _perfect_matching(edges: list[tuple[int, int]], n: int) -> list[int]:
    """Indices of n edges of a regular bipartite multigraph on n + n nodes that match every node (Kuhn)."""
    match_dst: dict[int, int] = {}  # dst node -> edge index

    def augment(src, seen):
        for e, (a, b) in enumerate(edges):
            if a == src and b not in seen:
                seen.add(b)
                if b not in match_dst or augment(edges[match_dst[b]][0], seen):
                    match_dst[b] = e
                    return True
        return False

    for src in range(n):
        if not augment(src, set()):
            raise AssertionError("a regular bipartite multigraph always has a perfect matching")
    return sorted(match_dst.values(), key=lambda e: edges[e][0])


def circular_rounds(stages: int, repeats: int) -> list[tuple[list[tuple[int, int]], list[int], list[int]]]:
    """How to move layer chunks from contiguous storage to their circular-schedule stages, by collective-permutes.

    Stored contiguously over `stage`, device d holds chunks d*r .. d*r + r-1 (local slot c % r); the circular
    schedule wants chunk c = j*p + s on stage s in slot j. Every device sends and receives r chunks, so the moves
    split into r perfect matchings (Konig): r rounds of one `ppermute` each. Returns, per round, the ppermute pairs
    (src, dst), the slot each device sends from and the slot each device receives into.
    """
    p, r = stages, repeats
    todo = [(c // r, c % p, c % r, c // p) for c in range(p * r)]  # (src, dst, src slot, dst slot)
    rounds = []
    while todo:
        picked = _perfect_matching([(a, b) for a, b, _, _ in todo], p)
        moves = [todo[e] for e in picked]
        send, recv = [0] * p, [0] * p
        for src, dst, src_slot, dst_slot in moves:
            send[src], recv[dst] = src_slot, dst_slot
        rounds.append(([(src, dst) for src, dst, _, _ in moves], send, recv))
        todo = [t for e, t in enumerate(todo) if e not in set(picked)]
    return rounds


def _move_chunks(w_rL: jax.Array, rounds, back: bool) -> jax.Array:
    """Inside the stage shard_map: `circular_rounds`' moves of this device's chunks [r, Lc, ...], or (`back`)
    the same moves undone."""
    s = jax.lax.axis_index(STAGE)
    out = jnp.zeros_like(w_rL)
    for pairs, send, recv in rounds:
        take, put = (recv, send) if back else (send, recv)
        pairs = [(dst, src) for src, dst in pairs] if back else pairs
        chunk = jax.lax.dynamic_index_in_dim(w_rL, jnp.asarray(take)[s], 0, keepdims=False)
        chunk = jax.lax.ppermute(chunk, STAGE, pairs)
        out = jax.lax.dynamic_update_index_in_dim(out, chunk, jnp.asarray(put)[s], 0)
    return out


def to_circular(w_rL: jax.Array, rounds) -> jax.Array:
    """This device's stored chunks [r, Lc, ...] -> its circular chunks [r, Lc, ...] (inside the stage shard_map)."""
    return _move_chunks(w_rL, rounds, back=False)


def from_circular(w_rL: jax.Array, rounds) -> jax.Array:
    """The inverse of `to_circular` (the explicit schedules' weight gradients back to the stored order)."""
    return _move_chunks(w_rL, rounds, back=True)


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking every m-th row, so each device's rows stay on that device."""
    x = x.reshape((x.shape[0] // m, m) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`: [m, B/m, ...] -> [B, ...]."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def index_leading(tree, i):
    """Every leaf of `tree` at index `i` (traced) of its leading axis."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def pipeline(
    stage_fn: Callable[[Any, jax.Array, Any], jax.Array],
    weights: Any,
    x_BTD: jax.Array,
    aux: Any,
    *,
    microbatches: int,
    repeats: int = 1,
    debug_nan_bubbles: bool = False,
    seq_axis: str = "seq",
    stage_stats: bool = False,
    seq_split: bool = False,
    stats_per_token: bool = True,
):
    """Run `stage_fn` over a stack of layers as a pipeline over the active mesh's `stage` axis.

    `weights` is a pytree whose leaves are stacked [L, ...] in layer order; `stage_fn(chunk_weights, x, aux)`
    applies one chunk of Lc = L/(p*r) consecutive layers (leaves [Lc, ...]) to a micro-batch `x` [B/m, T, D]
    with its slice of `aux` (a pytree of per-row arrays [B, ...], e.g. mask and rotary tables). Returns the
    activations after all L layers, [B, T, D], equal to running the L layers in order on the whole batch.
    `seq_axis` is the logical name of the activations' sequence dimension (`residual_seq` under sequence
    parallelism), so the buffer and the activations in flight between stages keep the stages' layout.

    With `stage_stats` (diagnostics), `stage_fn` returns (x, stats) where stats is a pytree of per-layer, per-row
    arrays [Lc, B/m, ...]; each stage files its chunks' stats of every micro-batch it works on (bubbles file
    nothing), and the pipeline returns (activations, stats [L, B, ...] in layer and row order).

    With `seq_split` the shard_map is manual over `context` too: the activations and every `aux` leaf are per
    token ([B, T, ...]), each device takes its part of the sequence, and `stage_fn` runs on it (ring attention's
    collectives then run in this shard_map rather than in one of their own nested inside it, which jax cannot
    differentiate: jaxllm/parallel/context.py). The stats are then per token too (`stats_per_token`, a probe's)
    or per row and already summed over `context` by `stage_fn` (a mixture of experts' router sums).
    """
    mesh = active_mesh()
    p, m, r = num_stages(mesh), microbatches, repeats
    num_layers = jax.tree.leaves(weights)[0].shape[0]
    if num_layers % (p * r):
        raise ValueError(f"{num_layers} layers do not split into stages*repeats = {p}*{r} chunks")
    if m < p:
        raise ValueError(f"{m} micro-batches cannot fill {p} stages")
    if x_BTD.shape[0] % m:
        raise ValueError(f"batch {x_BTD.shape[0]} does not split into {m} micro-batches")
    n_iter = m * r + p - 1

    chunk = num_layers // (p * r)
    rounds = circular_rounds(p, r) if r > 1 else None
    residual = ("batch", seq_axis, "embed")
    x_mBTD = constrain(split_microbatches(x_BTD, m), (None, *residual))
    aux_m = jax.tree.map(lambda a: split_microbatches(a, m), aux)

    @jax.checkpoint
    def body(w_local, aux_all, x_in, rep, mb):
        # Slicing inside the checkpoint keeps the residuals loop-invariant (whole weights / aux), not per step.
        out = stage_fn(index_leading(w_local, rep), x_in, index_leading(aux_all, mb))
        return out if stage_stats else (out, None)

    def per_stage(w_local, x_in_mBTD, aux_all):
        # This device's contiguous block of stored layers, as [r, Lc, ...]: already its chunks when r == 1.
        w_local = jax.tree.map(lambda w: w.reshape((r, chunk) + w.shape[1:]), w_local)
        if rounds is not None:
            w_local = jax.tree.map(lambda w: to_circular(w, rounds), w_local)
        s = jax.lax.axis_index(STAGE)
        ring = [(i, (i + 1) % p) for i in range(p)]
        buf = _promoted(lambda a: jax.lax.pcast(a, STAGE, to="varying"), x_in_mBTD)  # its transpose: a psum
        state = jnp.zeros_like(buf[0])
        # Per stage: [r, m, Lc, B/m, ...] stats of the chunks it runs, for each repeat and micro-batch.
        stats_shape = jax.eval_shape(lambda: body(w_local, aux_all, state, 0, 0)[1]) if stage_stats else None
        manual = (STAGE, CONTEXT) if seq_split and stats_per_token else STAGE
        filed_stats = jax.tree.map(lambda a: jax.lax.pcast(jnp.zeros((r, m) + a.shape, a.dtype), manual,
                                                           to="varying"), stats_shape)

        def step(carry, t):
            state, buf, filed_stats = carry
            k = t - s  # virtual micro-batch of this stage: micro-batch k % m, repeat k // m
            valid = (k >= 0) & (k < m * r)
            x = jnp.where(s == 0, index_leading(buf, t % m), state)
            if debug_nan_bubbles:
                x = jnp.where(valid, x, jnp.nan)
            x = jnp.where(valid, x, jnp.zeros_like(x))  # select, not multiply: garbage cannot leak
            rep = jnp.clip(k // m, 0, r - 1)
            with jax.named_scope("stage"):  # profiler traces: every device runs its own stage's layers here
                y, stats = body(w_local, aux_all, x, rep, jnp.mod(k, m))
            filed_stats = jax.tree.map(lambda f, a: jnp.where(valid, f.at[rep, jnp.mod(k, m)].set(a), f),
                                       filed_stats, stats)
            y = jnp.where(valid, y, jnp.zeros_like(y))
            y = constrain(jax.lax.ppermute(y, STAGE, ring), residual)
            # Stage 0 receives stage p-1's virtual micro-batch t-(p-1) and files it (next repeat's input / output).
            k_last = t - (p - 1)
            slot = jnp.mod(k_last, m)
            keep = (s == 0) & (k_last >= 0) & (k_last < m * r)
            filed = jnp.where(keep, y, index_leading(buf, slot))
            buf = jax.lax.dynamic_update_index_in_dim(buf, filed, slot, 0)
            return (y, constrain(buf, (None, *residual)), filed_stats), None

        (_, buf, filed_stats), _ = jax.lax.scan(step, (state, buf, filed_stats), jnp.arange(n_iter))
        # Outputs sit on stage 0; hand them to every stage (the head runs outside, replicated over `stage`).
        return _promoted(lambda a: jax.lax.psum(a, STAGE), jnp.where(s == 0, buf, jnp.zeros_like(buf))), filed_stats

    # [m, B/m, T, ...] activations and aux; per-stage stats [p*r, m, Lc, B/m, T, ...]
    tokens, stats_spec = (P(None, None, CONTEXT), P(STAGE, None, None, None, CONTEXT)) if seq_split else (P(), P(STAGE))
    stats_spec = stats_spec if stats_per_token else P(STAGE)
    out_mBTD, stats = jax.shard_map(
        per_stage, mesh=mesh, in_specs=(P(STAGE), tokens, jax.tree.map(lambda _: tokens, aux_m)),
        out_specs=(tokens, stats_spec), axis_names={STAGE, CONTEXT} if seq_split else {STAGE},
    )(weights, x_mBTD, aux_m)
    out_BTD = constrain(merge_microbatches(out_mBTD), residual)
    return (out_BTD, jax.tree.map(lambda a: _stats_in_layer_order(a, p, r), stats)) if stage_stats else out_BTD


def _stats_in_layer_order(filed: jax.Array, stages: int, repeats: int) -> jax.Array:
    """Stats filed per stage, [p*r, m, Lc, B/m, ...] (stage s, repeat j at row s*r + j: chunk j*p + s), as
    [L, B, ...] in layer order and the batch's own row order."""
    p, r = stages, repeats
    m, lc = filed.shape[1], filed.shape[2]
    by_chunk = filed.reshape((p, r) + filed.shape[1:]).swapaxes(0, 1).reshape((p * r,) + filed.shape[1:])
    by_layer = by_chunk.swapaxes(1, 2).reshape((p * r * lc, m) + filed.shape[3:])  # [L, m, B/m, ...]
    return jax.vmap(merge_microbatches)(by_layer)
