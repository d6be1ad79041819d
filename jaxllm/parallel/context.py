"""Context parallelism: the sequence split over the `context` mesh axis, attention across the split.

Everything but attention follows from one rule (jaxllm/parallel/sharding.RULES: `seq` splits over `context`): the
embedding, the norms, the projections, the MLP and the head work position by position. Attention needs every
earlier position of a token's document, so it is built here, in two ways (`model.context_attention`):

- all-gather: each layer gathers its keys and values over `context` (a sharding constraint; XLA's all-gather
  forward, reduce-scatter backward) and each device attends from its own queries to the whole sequence. Simple;
  each device holds the whole sequence's keys and values for one layer at a time (O(T)).
- ring (`ring_attention`): key/value blocks travel around the devices of the `context` axis with
  collective permutes inside a `jax.shard_map`; each device folds every block into a running (flash-style)
  softmax of its queries. Each device holds two blocks at a time (O(T / context)); the backward pass runs the
  ring again (a custom VJP), carrying the blocks' gradients home with them, rather than keeping every block.

Load balance under the causal mask: split in order, the device with the sequence's last chunk does most of the
attention work and the first does little. The model lays the sequence out so that device i holds chunk i and
chunk 2N-1-i of 2N (`to_balanced`; the zig-zag layout of Megatron and ring-flash-attention) and puts it back
before the head (`from_balanced`), so objectives, losses and data never see the permutation. Masks cannot use
array positions under that layout: each token carries its original index (`order`) beside its segment id, and a
key is visible to a query of the same document whose `order` is not smaller (`DocumentOrder`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.sharding import active_mesh, mesh_sizes, permutes_hang

CONTEXT = "context"
# Masked scores: a large finite negative as in jaxllm/model/layers.py (a fully masked block must not make NaN).
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def context_shards(mesh=None) -> int:
    """Size of the `context` axis of `mesh` (default: the active mesh; inside a shard_map manual over `context`,
    1); 1 when there is none."""
    mesh = active_mesh() if mesh is None else mesh
    if mesh is None or CONTEXT not in mesh.axis_names or CONTEXT in mesh.manual_axes:
        return 1
    return mesh_sizes(mesh)[CONTEXT]


def balanced_order(length: int, shards: int) -> np.ndarray:
    """The original index of each position of the balanced layout of `length` positions over `shards` devices:
    chunks of length / (2 * shards), device i holding chunk i then chunk 2 * shards - 1 - i."""
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.stack([chunks[:shards], chunks[shards:][::-1]], axis=1).reshape(length)


def to_balanced(x: jax.Array, shards: int) -> jax.Array:
    """`x` [B, T, ...] in the balanced layout along T (`balanced_order`): slices, a reversal and an interleave,
    which XLA moves between devices with collective permutes rather than gathering the sequence (except where
    those would hang: `_gathered_permute`)."""
    if permutes_hang():
        return _gathered_permute(x, shards, True)
    return _to_balanced(x, shards)


def from_balanced(x: jax.Array, shards: int) -> jax.Array:
    """`to_balanced` undone: `x` [B, T, ...] back in sequence order."""
    if permutes_hang():
        return _gathered_permute(x, shards, False)
    return _from_balanced(x, shards)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered_permute(x: jax.Array, shards: int, to: bool) -> jax.Array:
    """`to_balanced` (`to`) or `from_balanced` where collective permutes would hang (`permutes_hang`: XLA:CPU
    inside an explicit schedule's per-stage branch), through an all-gather of the sequence over `context`: every
    device permutes the whole sequence and keeps its own part. That holds a whole sequence per device for a
    moment, once at each edge of the model, where a permute moves only what changes device. By hand in a
    shard_map, as XLA's partitioner turns a gather and slices it lays out itself back into permutes; under a
    custom VJP (the other direction, moved the same way), as autodiff of a shard_map nested in the schedule's
    fails to verify (jax-ml/jax#26588, as for `ring_attention`)."""
    permute = _to_balanced if to else _from_balanced

    def per_device(part):
        whole = jax.lax.all_gather(part, CONTEXT, axis=1, tiled=True)
        length = part.shape[1]
        return jax.lax.dynamic_slice_in_dim(permute(whole, shards), jax.lax.axis_index(CONTEXT) * length, length,
                                            axis=1)

    seq = P(None, CONTEXT)
    return jax.shard_map(per_device, mesh=active_mesh(), in_specs=seq, out_specs=seq, axis_names={CONTEXT})(x)


def _gathered_permute_fwd(x, shards, to):
    return _gathered_permute(x, shards, to), None


def _gathered_permute_bwd(shards, to, _, d_out):
    """A permutation's transpose is its inverse."""
    return (_gathered_permute(d_out, shards, not to),)


_gathered_permute.defvjp(_gathered_permute_fwd, _gathered_permute_bwd)


def _to_balanced(x: jax.Array, shards: int) -> jax.Array:
    B, T = x.shape[:2]
    chunks = x.reshape((B, 2 * shards, T // (2 * shards)) + x.shape[2:])
    early, late = chunks[:, :shards], jnp.flip(chunks[:, shards:], axis=1)
    return jnp.stack([early, late], axis=2).reshape(x.shape)


def _from_balanced(x: jax.Array, shards: int) -> jax.Array:
    B, T = x.shape[:2]
    pairs = x.reshape((B, shards, 2, T // (2 * shards)) + x.shape[2:])
    early, late = pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)
    return jnp.concatenate([early, late], axis=1).reshape(x.shape)


class DocumentOrder(NamedTuple):
    """Who may see whom, for attention over a split sequence: per token [B, T] its packed document (`segment_ids`,
    0 for padding), its index in the unpermuted row (`order`), and its `window` (0: none), which limits it as a
    query to the last `window` positions of its document, itself included. All int32, per token: every field
    splits and travels like the tokens (a per-row or scalar window inside the pipeline's shard_map trips the
    nested shard_maps' sharding checks)."""

    segment_ids: jax.Array
    order: jax.Array
    window: jax.Array


def document_order(segment_ids_BT: jax.Array, order_BT: jax.Array, window: int = 0) -> DocumentOrder:
    """The `DocumentOrder` of tokens whose layers all look back `window` positions (0: the whole document)."""
    return DocumentOrder(segment_ids_BT, order_BT, jnp.full(order_BT.shape, window, jnp.int32))


def visible(queries: DocumentOrder, keys: DocumentOrder) -> jax.Array:
    """[B, T, S] boolean: key s is in query t's document, not after it, and within its window."""
    q_order, k_order = queries.order[:, :, None], keys.order[:, None, :]
    behind = q_order - k_order
    window = queries.window[:, :, None]
    in_window = (window == 0) | (behind < window)
    same = queries.segment_ids[:, :, None] == keys.segment_ids[:, None, :]
    return same & (behind >= 0) & in_window


def ring_attention(q_BTNH, k_BSKH, v_BSKH, who: DocumentOrder, scale: float, balanced: bool = True) -> jax.Array:
    """Grouped-query attention [B, T, N, H] of a sequence split over the active mesh's `context` axis, by the ring
    (see the module docstring); `who` says who may see whom, and its tokens are laid out as the activations'.

    `balanced`: the tokens are in the balanced layout (`to_balanced`) under a causal mask, so at every step but
    the first each device computes only the half of the block the mask leaves visible: with the keys of device j
    < i, device i's queries see only j's early chunk; with j > i only its late chunk sees j's keys at all.

    The custom VJP wraps two shard_maps (forward, backward) rather than sitting inside one, so autodiff never
    differentiates a shard_map here. Inside the pipeline the ring runs in the pipeline's own shard_map, which is
    then manual over `context` as well as `stage` (`pipeline(seq_split=True)`): a ring shard_map nested in the
    pipeline's failed to verify on jax 0.10 and 0.12, in the gradient only (the pipeline body's remat partially
    evaluated the nested forward shard_map, and its int32 residuals that vary over `context` but not `stage` got
    a local shape split once too often, as jax-ml/jax#26588).
    """
    static = (scale, mesh_sizes(active_mesh())[CONTEXT], balanced)
    return _ring_attention(q_BTNH, k_BSKH, v_BSKH, who, static)


def _on_each_device(per_device, num_arrays: int, num_out: int):
    """`per_device` as a shard_map manual over `context` of `num_arrays` arrays split along their second
    dimension, then a `DocumentOrder`, returning `num_out` arrays split the same way; `per_device` itself where
    `context` is manual already (the pipeline's shard_map, `jaxllm.parallel.pipeline.pipeline(seq_split=True)`):
    the arrays are this device's chunks there."""
    if CONTEXT in active_mesh().manual_axes:
        return per_device
    seq = P(None, CONTEXT)
    in_specs = (seq,) * 3 + (DocumentOrder(seq, seq, seq),) + (seq,) * (num_arrays - 3)
    return jax.shard_map(per_device, mesh=active_mesh(), in_specs=in_specs, out_specs=(seq,) * num_out,
                         axis_names={CONTEXT})


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_attention(q_BTNH, k_BSKH, v_BSKH, who: DocumentOrder, static: tuple):
    return _ring_fwd(q_BTNH, k_BSKH, v_BSKH, who, static)[0]


def _grouped(x_BTNX, kv_heads: int):
    """[B, T, N, ...] -> [B, K, G, T, ...]: query heads as (kv head, group) with the sequence after them."""
    B, T, N = x_BTNX.shape[:3]
    x = x_BTNX.reshape((B, T, kv_heads, N // kv_heads) + x_BTNX.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def _ungrouped(x_BKGTX):
    """`_grouped` undone: [B, K, G, T, ...] -> [B, T, N, ...]."""
    x = jnp.moveaxis(x_BKGTX, 3, 1)
    return x.reshape(x.shape[:2] + (x.shape[2] * x.shape[3],) + x.shape[4:])


def _ring_fwd(q_BTNH, k_BSKH, v_BSKH, who, static):
    def per_device(q_BTNH, k_BSKH, v_BSKH, who):
        B, T, N, H = q_BTNH.shape
        K = k_BSKH.shape[2]
        q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
        out_BKGTH, lse_BKGT = _ring_forward(q_BTKGH, k_BSKH, v_BSKH, who, static)
        return _ungrouped(out_BKGTH).astype(v_BSKH.dtype), _ungrouped(lse_BKGT)

    out_BTNH, lse_BTN = _on_each_device(per_device, 3, 2)(q_BTNH, k_BSKH, v_BSKH, who)
    return out_BTNH, (q_BTNH, k_BSKH, v_BSKH, who, out_BTNH, lse_BTN)


def _ring_bwd(static, residuals, d_out_BTNH):
    """The flash-attention backward around the ring (`_ring_backward`)."""
    q_BTNH, k_BSKH, v_BSKH, who, out_BTNH, lse_BTN = residuals

    def per_device(q_BTNH, k_BSKH, v_BSKH, who, out_BTNH, lse_BTN, d_out_BTNH):
        K = k_BSKH.shape[2]
        d_out = _grouped(d_out_BTNH, K).astype(jnp.float32)
        back = _Backward(d_out, _grouped(lse_BTN, K), jnp.sum(d_out * _grouped(out_BTNH, K), axis=-1))
        B, T, N, H = q_BTNH.shape
        q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
        d_q_BTKGH, d_k, d_v = _ring_backward(q_BTKGH, k_BSKH, v_BSKH, who, back, static)
        d_q = d_q_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype)
        return d_q, d_k.astype(k_BSKH.dtype), d_v.astype(v_BSKH.dtype)

    grads = _on_each_device(per_device, 6, 3)(q_BTNH, k_BSKH, v_BSKH, who, out_BTNH, lse_BTN, d_out_BTNH)
    no_grad = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), who)
    return (*grads, no_grad)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _pass_on(tree, shards: int):
    """Each device's `tree` to the next device of the ring (the last to the first). Where collective permutes
    would hang (`permutes_hang`: XLA:CPU inside an explicit schedule's branch), through an all-gather over
    `context`, each device keeping the previous device's: `shards` times the bytes, the same values."""
    if permutes_hang():
        previous = (jax.lax.axis_index(CONTEXT) - 1) % shards
        return jax.tree.map(lambda a: jax.lax.all_gather(a, CONTEXT)[previous], tree)
    return jax.lax.ppermute(tree, CONTEXT, [(i, (i + 1) % shards) for i in range(shards)])


def _rows(who: DocumentOrder, part: slice) -> DocumentOrder:
    return DocumentOrder(*(field[:, part] for field in who))


def _halves(length: int) -> tuple[slice, slice]:
    """A device's early and late chunk of its `length` positions in the balanced layout."""
    return slice(0, length // 2), slice(length // 2, None)


def _keys_early(step: int):
    """At ring step `step` > 0 this device holds device (i - step)'s block: below its own index exactly when
    step <= i, and then only that block's early chunk is visible; else only this device's late queries see it."""
    return step <= jax.lax.axis_index(CONTEXT)


def _block_scores(q_BTKGH, k_BSKH, queries: DocumentOrder, keys: DocumentOrder, scale: float):
    """(scores [B, K, G, T, S] in float32 with masked ones at the floor, visibility [B, 1, 1, T, S])."""
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
    seen = visible(queries, keys)[:, None, None]
    return jnp.where(seen, scores, _MASKED), seen


class _Running(NamedTuple):
    """The online softmax of some queries so far: running maximum `peak` and sum of exponentials `total` [B, K,
    G, T], and running weighted sum of values `acc` [B, K, G, T, H], all float32."""

    peak: jax.Array
    total: jax.Array
    acc: jax.Array

    def rows(self, part: slice) -> "_Running":
        return _Running(self.peak[..., part], self.total[..., part], self.acc[..., part, :])

    def with_rows(self, part: slice, new: "_Running") -> "_Running":
        return _Running(self.peak.at[..., part].set(new.peak), self.total.at[..., part].set(new.total),
                        self.acc.at[..., part, :].set(new.acc))


def _fold(run: _Running, q_BTKGH, k_BSKH, v_BSKH, queries: DocumentOrder, keys: DocumentOrder, scale: float):
    """`run` with one more block of keys and values folded in."""
    scores, seen = _block_scores(q_BTKGH, k_BSKH, queries, keys, scale)
    peak = jnp.maximum(run.peak, scores.max(-1))
    weights = jnp.where(seen, jnp.exp(scores - peak[..., None]), 0.0)
    rescale = jnp.exp(run.peak - peak)
    values = jnp.einsum("BKGTS,BSKH->BKGTH", weights.astype(v_BSKH.dtype), v_BSKH, preferred_element_type=jnp.float32)
    return _Running(peak, run.total * rescale + weights.sum(-1), run.acc * rescale[..., None] + values)


def _fold_visible_half(run: _Running, q_BTKGH, k_BSKH, v_BSKH, who: DocumentOrder, keys: DocumentOrder,
                       scale: float, step: int) -> _Running:
    """`_fold` of the half of a block the causal mask leaves visible in the balanced layout (`_keys_early`)."""
    early, late = _halves(q_BTKGH.shape[1])

    def early_keys(run):
        return _fold(run, q_BTKGH, k_BSKH[:, early], v_BSKH[:, early], who, _rows(keys, early), scale)

    def late_queries(run):
        return run.with_rows(late, _fold(run.rows(late), q_BTKGH[:, late], k_BSKH, v_BSKH, _rows(who, late), keys,
                                         scale))

    return jax.lax.cond(_keys_early(step), early_keys, late_queries, run)


def _ring_forward(q_BTKGH, k_BSKH, v_BSKH, who: DocumentOrder, static: tuple):
    """(output [B, K, G, T, H] float32, log-sum-exp of each query's scores [B, K, G, T]); `static` is (scale,
    shards, balanced)."""
    scale, shards, balanced = static
    B, T, K, G, H = q_BTKGH.shape
    run = _Running(jnp.full((B, K, G, T), _MASKED, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
                   jnp.zeros((B, K, G, T, H), jnp.float32))
    block = (k_BSKH, v_BSKH, who)
    for step in range(shards):  # unrolled: XLA may overlap the next block's permute with this block's work
        if step:
            block = _pass_on(block, shards)
        k, v, keys = block
        if step and balanced:
            run = _fold_visible_half(run, q_BTKGH, k, v, who, keys, scale, step)
        else:
            run = _fold(run, q_BTKGH, k, v, who, keys, scale)
    safe = jnp.where(run.total > 0, run.total, 1.0)  # every token sees itself; padding-only rows would have nothing
    return run.acc / safe[..., None], run.peak + jnp.log(safe)


class _Backward(NamedTuple):
    """What every block's gradients need of the queries' side: the output's gradient `d_out` [B, K, G, T, H],
    the log-sum-exp `lse` and softmax's backward term `row_dot` = sum_s p * dp [B, K, G, T], float32."""

    d_out: jax.Array
    lse: jax.Array
    row_dot: jax.Array

    def rows(self, part: slice) -> "_Backward":
        return _Backward(self.d_out[..., part, :], self.lse[..., part], self.row_dot[..., part])


def _block_grads(q_BTKGH, k_BSKH, v_BSKH, back: _Backward, queries: DocumentOrder, keys: DocumentOrder,
                 scale: float):
    """(d_q [B, T, K, G, H], d_k, d_v [B, S, K, H]), float32, of one block."""
    scores, seen = _block_scores(q_BTKGH, k_BSKH, queries, keys, scale)
    probs = jnp.where(seen, jnp.exp(scores - back.lse[..., None]), 0.0)
    d_v = jnp.einsum("BKGTS,BKGTH->BSKH", probs, back.d_out)
    d_probs = jnp.einsum("BKGTH,BSKH->BKGTS", back.d_out, v_BSKH.astype(jnp.float32))
    d_scores = probs * (d_probs - back.row_dot[..., None]) * scale
    d_q = jnp.einsum("BKGTS,BSKH->BTKGH", d_scores, k_BSKH.astype(jnp.float32))
    d_k = jnp.einsum("BKGTS,BTKGH->BSKH", d_scores, q_BTKGH.astype(jnp.float32))
    return d_q, d_k, d_v


def _visible_half_grads(q_BTKGH, k_BSKH, v_BSKH, back: _Backward, who: DocumentOrder, keys: DocumentOrder,
                        scale: float, step: int):
    """`_block_grads` of the half of a block the causal mask leaves visible, as the forward's
    `_fold_visible_half`, padded with zeros to the whole block's shapes."""
    early, late = _halves(q_BTKGH.shape[1])

    def early_keys():
        d_q, d_k, d_v = _block_grads(q_BTKGH, k_BSKH[:, early], v_BSKH[:, early], back, who, _rows(keys, early),
                                     scale)
        pad = lambda g: jnp.zeros(k_BSKH.shape, jnp.float32).at[:, early].set(g)
        return d_q, pad(d_k), pad(d_v)

    def late_queries():
        d_q, d_k, d_v = _block_grads(q_BTKGH[:, late], k_BSKH, v_BSKH, back.rows(late), _rows(who, late), keys,
                                     scale)
        return jnp.zeros(q_BTKGH.shape, jnp.float32).at[:, late].set(d_q), d_k, d_v

    return jax.lax.cond(_keys_early(step), early_keys, late_queries)


def _ring_backward(q_BTKGH, k_BSKH, v_BSKH, who: DocumentOrder, back: "_Backward", static: tuple):
    """(d_q [B, T, K, G, H], d_k, d_v [B, S, K, H]) float32 on one device: each block's key/value gradients travel
    with it and, after one more hop than the forward's, arrive back at the device that owns the block."""
    scale, shards, balanced = static
    d_q = jnp.zeros(q_BTKGH.shape, jnp.float32)
    block = (k_BSKH, v_BSKH, who)
    grads = (jnp.zeros(k_BSKH.shape, jnp.float32), jnp.zeros(v_BSKH.shape, jnp.float32))
    for step in range(shards):
        if step:
            block, grads = _pass_on((block, grads), shards)
        k, v, keys = block
        if step and balanced:
            step_q, step_k, step_v = _visible_half_grads(q_BTKGH, k, v, back, who, keys, scale, step)
        else:
            step_q, step_k, step_v = _block_grads(q_BTKGH, k, v, back, who, keys, scale)
        d_q, grads = d_q + step_q, (grads[0] + step_k, grads[1] + step_v)
    return (d_q, *_pass_on(grads, shards))
