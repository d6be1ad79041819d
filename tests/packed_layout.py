"""What cuDNN's packed-document layout means, written independently of the code that builds it: the [B, T, S]
mask its document offsets and lengths describe (causal within each listed run of tokens). Used to check the
layout on CPU, and as the CPU stand-in for the cuDNN kernel."""

import jax.numpy as jnp


def mask_from_packed_layout(offsets_BM1, lengths_BM, T: int):
    """[B, T, S] boolean visibility of a packed layout (entries with length -1 are unused)."""
    t = jnp.arange(T)
    starts_BM = jnp.asarray(offsets_BM1)[:, :-1]
    lengths_BM = jnp.asarray(lengths_BM)
    inside_BMT = (starts_BM[..., None] <= t) & (t < (starts_BM + lengths_BM)[..., None]) & (lengths_BM[..., None] > 0)
    listed_BT = inside_BMT.any(axis=1)
    run_BT = jnp.argmax(inside_BMT, axis=1)
    same_BTS = (run_BT[:, :, None] == run_BT[:, None, :]) & listed_BT[:, :, None] & listed_BT[:, None, :]
    return same_BTS & (t[:, None] >= t[None, :])
