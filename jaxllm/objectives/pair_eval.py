"""Accuracy of a scored preference set, per kind of pair and on a length-matched subset, before and after
training (the reward model's and DPO's task report, and `scripts/eval.py --reward`).

A pair is length-matched when its two responses differ by at most LENGTH_TOLERANCE of the longer one, in tokens:
a scorer that only prefers the longer (or shorter) response is at chance there.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxllm.train.step import batch_sharding

ALL = "all"
LENGTH_MATCHED = "length_matched"
LENGTH_TOLERANCE = 0.1


def score_rows(graphdef, variables, mesh, rows: dict[str, np.ndarray], batch_size: int,
               score: Callable) -> dict[str, np.ndarray]:
    """`score(model, batch)` ({name: [B, K]}) over every row of `rows` (numpy, leading axis R, per field), as
    numpy [R, K] per name. Every process passes all rows; each device takes its shard of each batch."""
    sharding = batch_sharding(mesh)
    fn = jax.jit(lambda v, b: score(nnx.merge(graphdef, v), b),
                 out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    total = len(rows["tokens"])
    out: dict[str, list] = {}
    with jax.set_mesh(mesh):
        for start in range(0, total, batch_size):
            batch = {f: np.zeros((batch_size,) + v.shape[1:], v.dtype) for f, v in rows.items()}
            for f, v in rows.items():
                part = v[start:start + batch_size]
                batch[f][:len(part)] = part
            placed = {f: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
                      for f, v in batch.items()}
            for name, value in jax.device_get(fn(variables, placed)).items():
                out.setdefault(name, []).append(np.asarray(value)[:min(batch_size, total - start)])
    return {name: np.concatenate(parts) for name, parts in out.items()}


def groups(pairs: list[dict]) -> dict[str, list[int]]:
    """Indices of the pairs in each report group: all, each kind, and the length-matched subset."""
    out: dict[str, list[int]] = {ALL: list(range(len(pairs)))}
    for i, p in enumerate(pairs):
        out.setdefault(p["kind"], []).append(i)
    out[LENGTH_MATCHED] = [i for i, p in enumerate(pairs)
                           if abs(p["chosen_tokens"] - p["rejected_tokens"])
                           <= LENGTH_TOLERANCE * max(p["chosen_tokens"], p["rejected_tokens"])]
    return out


def accuracy_report(pairs: list[dict], correct: dict[str, np.ndarray]) -> dict:
    """{"scores": {group: {"examples": n, name: % correct}}, "samples": []} for the per-pair booleans in
    `correct` (indexed like `pairs`)."""
    scores = {}
    for group, members in groups(pairs).items():
        if members:
            scores[group] = {"examples": len(members),
                             **{name: 100.0 * float(np.mean(c[members])) for name, c in correct.items()}}
    return {"scores": scores, "samples": []}


def per_pair(pairs: list[dict], values: np.ndarray) -> np.ndarray:
    """[R, K] row values -> one per pair, in the order of `pairs` ({"row", "slot", ...})."""
    return np.asarray([values[p["row"], p["slot"]] for p in pairs])
