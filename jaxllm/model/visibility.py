"""Who may attend to whom in a batch of packed rows, in the forms the attention implementations take.

Training rows pack several documents (`segment_ids`, 1-based per row, 0 for padding); each token may see only
itself and earlier tokens of its own document. The einsum and jax.nn paths take that as a dense [B, T, S] mask;
cuDNN's fused kernel takes it as each row's document offsets and lengths (its packed-sequence layout), which lets
it skip the masked tiles instead of reading a [B, T, S] bias.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.parallel.context import document_order, visible

# Documents per row that cuDNN's packed layout is built for. cuDNN's workspace grows with this bound (T = 4096
# slots asked for 1 TiB on an H200; 64 fit, as fast as 4 documents need); rows with more documents fall back to
# the masked kernel (see `jaxllm.model.cudnn_attention`).
PACKED_DOCUMENTS = 64


def attention_mask(segment_ids_BT: jax.Array, window: int = 0, order_BT: jax.Array | None = None) -> jax.Array:
    """[B, T, S] boolean: causal, and only within the same packed document (segment); with a `window`, only the
    last `window` positions, the token's own included (Hugging Face's sliding window: key > query - window).
    `order_BT`: each token's index in its unpermuted row, when the row is laid out in another order (context
    parallelism's balanced layout); None: the row is in order."""
    if order_BT is not None:
        tokens = document_order(segment_ids_BT, order_BT, window)
        return visible(tokens, tokens)
    T = segment_ids_BT.shape[1]
    behind_TS = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]
    causal_TS = (behind_TS >= 0) & (behind_TS < window) if window else behind_TS >= 0
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return causal_TS[None] & same_BTS


class PackedSegments(NamedTuple):
    """A batch's documents as cuDNN's packed layout. Per row: the start `offsets` [B, M+1] and `lengths` [B, M]
    of each run of equal segment ids, padded with -1; `fits` [B] says the row has at most M runs (else its
    layout is cut short and unusable); `segment_ids` [B, T] are kept for the masked fallback."""

    offsets: jax.Array
    lengths: jax.Array
    fits: jax.Array
    segment_ids: jax.Array


def packed_segments(segment_ids_BT: jax.Array, max_runs: int = PACKED_DOCUMENTS) -> PackedSegments:
    """The packed layout of `segment_ids_BT` [B, T] for up to `max_runs` runs per row (padding, id 0, is one more
    run: its rows are masked out of the loss anyway)."""
    B, T = segment_ids_BT.shape
    M = min(max_runs, T)
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    run_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32) - 1
    lengths_BM = jax.vmap(lambda run_T: jnp.zeros((M,), jnp.int32).at[run_T].add(1, mode="drop"))(run_BT)
    offsets_BM = jnp.cumsum(lengths_BM, axis=1) - lengths_BM
    used_BM = jnp.arange(M)[None] <= run_BT[:, -1:]
    return PackedSegments(
        offsets=jnp.concatenate([jnp.where(used_BM, offsets_BM, -1), jnp.full((B, 1), -1, jnp.int32)], axis=1),
        lengths=jnp.where(used_BM, lengths_BM, -1),
        fits=run_BT[:, -1] < M,
        segment_ids=segment_ids_BT,
    )


def gpu_attention(impl: str, compute_dtype) -> str:
    """The attention implementation `model.attention=impl` means on a GPU: 'auto' is cuDNN's fused kernel when
    computing in bf16/fp16 (the einsum path materialises [B, K, G, T, S] float32 scores per layer: llama_1b at
    8 x 2048 asked for 64 GiB more than an H200 holds), else the einsum path."""
    if impl != "auto":
        return impl
    half = jnp.dtype(compute_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if half else "xla"


def resolve_attention(impl: str, compute_dtype) -> str:
    """The attention implementation `model.attention=impl` means on this run's backend: `gpu_attention` on GPUs,
    the einsum path elsewhere."""
    if impl != "auto" or jax.default_backend() == "gpu":
        return gpu_attention(impl, compute_dtype)
    return "xla"


def attention_visibility(impl: str, segment_ids_BT: jax.Array, window: int = 0, order_BT: jax.Array | None = None):
    """Visibility in the form attention `impl` takes: the [B, T, S] mask (limited to a sliding `window` when it
    is not 0), for cuDNN the packed layout, which takes its window in the kernel call, or for context
    parallelism's ring each token's document and index (`jaxllm.parallel.context.DocumentOrder`); built once
    per batch and shared by every layer. `order_BT` as `attention_mask`."""
    if impl == "cudnn":
        return packed_segments(segment_ids_BT)
    if impl == "ring":
        return document_order(segment_ids_BT, order_BT, window)
    return attention_mask(segment_ids_BT, window, order_BT)
