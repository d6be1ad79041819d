"""cuDNN fused attention over packed documents (`model.attention=cudnn`, GPUs only).

`jax.nn.dot_product_attention(implementation="cudnn")` can express "causal within each document" only as a dense
[B, 1, T, S] mask, which it turns into an additive bias read for every score. cuDNN's packed-sequence layout says
the same with document offsets and lengths and skips the masked tiles: on an H200 (B4 T4096 N32/K8 H64, bf16,
forward + backward) 3.4 ms against 7.8 ms with the mask, same results (scripts/bench_attention.py). JAX exposes
that layout only in its cuDNN module, not in `jax.nn`, hence the private import (same signature in jax 0.10-0.12).
"""

from __future__ import annotations

import jax

from jaxllm.config.schema import ConfigError
from jaxllm.model.visibility import PackedSegments, attention_mask


def private_cudnn_attention():
    """(MaskType, dot_product_attention) of JAX's private cuDNN module: the packed (offsets) kernel that
    jax.nn.dot_product_attention does not expose. Private, so tests/test_private_imports.py imports it here."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    return MaskType, dot_product_attention


def cudnn_attention(q_BTNH, k_BSKH, v_BSKH, segments: PackedSegments, window: int = 0,
                    scale: float | None = None) -> jax.Array:
    """Causal attention within each packed document by cuDNN (bf16/fp16 inputs, grouped-query heads allowed),
    over the last `window` positions only when it is not 0 (a sliding window, the token's own included), scores
    scaled by `scale` (None: head_dim ** -0.5).

    Uses the packed layout when every row fits its bound, else the masked kernel: both are compiled, and the
    batch picks one at run time, so a row of unusually many short documents is slower, never wrong.
    """
    if jax.default_backend() != "gpu":  # cuDNN's own failure here would be a lowering traceback
        raise ConfigError("model.attention", f"'cudnn' needs GPUs; this run has {jax.default_backend()} devices "
                                             "(use 'xla' or 'dot_product')")
    MaskType, dot_product_attention = private_cudnn_attention()
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else scale

    def packed(q, k, v):
        return dot_product_attention(
            q, k, v, q_seqlen=segments.lengths, kv_seqlen=segments.lengths, q_offsets=segments.offsets,
            kv_offsets=segments.offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL,
            sliding_window_length=window or None)

    def masked(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=attention_mask(segments.segment_ids, window)[:, None],
                                            scale=scale, implementation="cudnn")

    return jax.lax.cond(segments.fits.all(), packed, masked, q_BTNH, k_BSKH, v_BSKH)
