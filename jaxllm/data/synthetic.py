"""Random packed batches with the same fields and invariants as the real pipeline's, for tests and benchmarks
that must not depend on a prepared token store."""

from __future__ import annotations

import numpy as np


def synthetic_batch(seed: int, batch_size: int, seq_len: int, vocab_size: int, max_docs: int = 3) -> dict:
    """A batch of `batch_size` rows, each packing 1..max_docs documents of random tokens (and some padding)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int64)
    segment_ids = np.zeros((batch_size, seq_len), np.int32)
    positions = np.zeros((batch_size, seq_len), np.int32)
    for row in range(batch_size):
        used = int(rng.integers(seq_len // 2, seq_len + 1))  # the rest is padding
        cuts = np.sort(rng.choice(np.arange(1, used), size=min(max_docs - 1, used - 1), replace=False))
        bounds = [0, *cuts.tolist(), used]
        for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
            segment_ids[row, a:b] = doc
            positions[row, a:b] = np.arange(b - a)
    next_segment = np.concatenate([segment_ids[:, 1:], np.zeros((batch_size, 1), np.int32)], axis=1)
    loss_mask = ((segment_ids > 0) & (next_segment == segment_ids)).astype(np.int32)
    return {
        "tokens": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": loss_mask,
    }
