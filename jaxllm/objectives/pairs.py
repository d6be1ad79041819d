"""Per-sequence values of preference rows (jaxllm/data/preference.py): pair p of a row is segment 2p + 1
(chosen) and 2p + 2 (rejected). Everything is a dense product with a one-hot of the segment ids, so it shards
like the batch and needs no gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _segment_one_hot(segment_ids_BT, pairs_per_row: int):
    """[B, T, 2K] float32: position t belongs to sequence s (0-based: segment s + 1)."""
    return jax.nn.one_hot(segment_ids_BT - 1, 2 * pairs_per_row, dtype=jnp.float32)


def per_sequence_sums(values_BT, segment_ids_BT, pairs_per_row: int):
    """(chosen [B, K], rejected [B, K]): the sums of `values_BT` over each pair's sequences."""
    sums_BS = jnp.einsum("bt,bts->bs", values_BT.astype(jnp.float32),
                         _segment_one_hot(segment_ids_BT, pairs_per_row))
    return sums_BS[:, 0::2], sums_BS[:, 1::2]


def last_tokens(segment_ids_BT):
    """[B, T] float32: 1 at the last position of every sequence (where the next position's segment differs)."""
    following = jnp.concatenate([segment_ids_BT[:, 1:], jnp.zeros_like(segment_ids_BT[:, :1])], axis=1)
    return ((segment_ids_BT > 0) & (following != segment_ids_BT)).astype(jnp.float32)


def at_last_tokens(values_BT, segment_ids_BT, pairs_per_row: int):
    """(chosen [B, K], rejected [B, K]): `values_BT` at each pair's sequences' last tokens (0 for absent pairs)."""
    return per_sequence_sums(values_BT * last_tokens(segment_ids_BT), segment_ids_BT, pairs_per_row)


def pair_mask(segment_ids_BT, pairs_per_row: int):
    """[B, K] float32: 1 where the row holds pair k."""
    present = per_sequence_sums(jnp.ones(segment_ids_BT.shape, jnp.float32), segment_ids_BT, pairs_per_row)[0]
    return (present > 0).astype(jnp.float32)


def masked_mean(values, mask):
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)
