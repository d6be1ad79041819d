"""Model-side statistics of one diagnostic forward pass: what the residual stream, the SwiGLU gates, attention
and the output head look like on a batch, per layer.

`activation_stats` runs the model once (no gradients, no dropout) with a probe in place of each layer's plain
call (`Transformer.probed_hidden_states`): the probe takes per-token statistics of the layer's output and of the
intermediates its attention and MLP put into a `taps` dict, and the layer loop (scanned, unrolled or pipelined)
returns them as extra outputs. The switch is static: the training forward never passes a probe, so its traced
program, and the hot train step's HLO, are what they were without diagnostics.

The statistics, all float32 ([L] arrays per layer, then scalars):
  act_rms [L]          RMS of the residual stream at each layer's output, over the valid tokens of the batch
                       (segment id > 0; padding excluded) and every model dimension.
  act_max [L]          max |x| of the same.
  gate_saturation [L]  fraction of the SwiGLU gate pre-activations g (valid tokens x mlp units) with
                       g < GATE_SATURATION: see there.
  attn_logit_max [L]   max of q.k / sqrt(H) over the positions a valid query may see (every head), on the einsum
                       paths (`model.attention` xla, dot_product); with cuDNN's fused kernel the scores never exist,
                       so the bound max ||q|| * max ||k|| / sqrt(H) over the batch's valid tokens instead.
  logits_max           max output logit over valid tokens (language models only: a reward model has no vocabulary
                       head, and gets no logits_* entries).
  logits_lse_mean      mean over valid tokens of the log-sum-exp of the output logits (log V when all logits are 0;
                       it drifts away as the logits' scale grows, which is what z-loss penalises).

Non-finite values propagate: a layer whose output, gate pre-activations or attention logits are non-finite
anywhere in the batch, padding included (a NaN there still reaches the loss as 0 * NaN), reports NaN for all its
statistics, and so does every later layer that reads its output. `first_nonfinite_layer` names the first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.model.head import chunked as chunked_head  # the head's own chunking: the same memory bound
from jaxllm.model.reward import RewardModel
from jaxllm.parallel.context import CONTEXT, DocumentOrder
from jaxllm.parallel.context import visible as visible_pairs
from jaxllm.parallel.pipeline import split_microbatches
from jaxllm.parallel.sharding import active_mesh

# A SwiGLU unit computes silu(g) * up with silu(g) = g * sigmoid(g). For g < -6 the gate is shut: its output
# |silu(g)| < 0.015 and its slope |silu'(g)| < 0.0124, about 1% of the slope 1 of its open (linear) regime, so
# the unit passes neither signal nor gradient (the SwiGLU analogue of a dead ReLU). Large positive g is not
# saturation for silu: its slope tends to 1 there.
GATE_SATURATION = -6.0

PER_LAYER = ("act_rms", "act_max", "gate_saturation", "attn_logit_max")


def probe_layer(layer, x_BTD, visible, sin_BTh, cos_BTh, key, local=None):
    """Run one DecoderLayer on `x_BTD` and take per-token statistics ([B, T] arrays) of its output, its gate
    pre-activations and its attention logits: the probe of `Transformer.probed_hidden_states`. Per token (not
    yet reduced) so the pipeline can put micro-batches back together and the reduction can skip padding."""
    taps = {}
    out_BTD = layer(x_BTD, visible, sin_BTh, cos_BTh, key, taps=taps, local=local)
    out_BTD32 = out_BTD.astype(jnp.float32)
    # A mixture of experts' gates run per routed (token, expert) pair, not per token: none are measured there yet.
    gate_BTF = taps["gate"].astype(jnp.float32) if "gate" in taps else jnp.zeros(out_BTD.shape[:2] + (1,))
    stats = {
        "sq_sum": jnp.sum(out_BTD32 * out_BTD32, axis=-1),
        "abs_max": jnp.max(jnp.abs(out_BTD32), axis=-1),
        "gate_saturated": jnp.sum((gate_BTF < GATE_SATURATION).astype(jnp.float32), axis=-1),
        **_attention_logits(layer.self_attn.impl, taps["q"], taps["k"], visible),
    }
    finite_BT = jnp.all(jnp.isfinite(out_BTD32), axis=-1) & jnp.all(jnp.isfinite(gate_BTF), axis=-1)
    for name in ("attn_logit_max", "q_norm", "k_norm"):
        if name in stats:
            finite_BT &= jnp.isfinite(stats[name])
    return out_BTD, {**stats, "finite": finite_BT}


def _attention_logits(impl: str, q_BTNH, k_BSKH, visible) -> dict:
    """Per query token: the max scaled score over the keys it sees and every head (einsum paths, `visible` the
    [B, T, S] mask or the ring's `DocumentOrder`), or for cuDNN (whose scores never exist) each token's largest
    query and key norm."""
    H = q_BTNH.shape[-1]
    if impl == "cudnn":
        norm = lambda a: jnp.max(jnp.linalg.norm(a.astype(jnp.float32), axis=-1), axis=-1)
        return {"q_norm": norm(q_BTNH), "k_norm": norm(k_BSKH)}
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    if isinstance(visible, DocumentOrder):  # the ring's visibility over a split sequence: as a mask here
        keys = visible
        mesh = active_mesh()
        if mesh is not None and CONTEXT in mesh.manual_axes:  # inside the pipeline: each device holds its part
            gather = lambda a: jax.lax.all_gather(a, CONTEXT, axis=1, tiled=True)  # noqa: E731
            k_BSKH, keys = gather(k_BSKH), jax.tree.map(gather, keys)
        visible = visible_pairs(visible, keys)
    # The scores of jaxllm.model.layers.xla_attention (same einsum, dtype and scale).
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH).astype(jnp.float32) * H**-0.5
    scores_BKGTS = jnp.where(visible[:, None, None], scores_BKGTS, -jnp.inf)
    return {"attn_logit_max": jnp.max(scores_BKGTS, axis=(1, 2, 4))}


def _per_token_stats(model, tokens_BT, segment_ids_BT, positions_BT) -> dict:
    """Every layer's probe statistics [L, B, T] and the head's ("logits_max", "logits_lse") [B, T]."""
    x_BTD, stats = model.probed_hidden_states(tokens_BT, segment_ids_BT, positions_BT, probe_layer)
    if isinstance(model, RewardModel):
        return stats

    def head(x_BCD, _):
        logits_BCV = model.logits(x_BCD).astype(jnp.float32)
        return jnp.max(logits_BCV, axis=-1), jax.nn.logsumexp(logits_BCV, axis=-1)

    chunk, T = model.cfg.loss_chunk, tokens_BT.shape[1]
    if chunk and chunk < T:  # never the whole [B, T, V] logits when training avoids them
        max_BT, lse_BT = chunked_head(head, x_BTD, jnp.zeros_like(tokens_BT), chunk)
    else:
        max_BT, lse_BT = head(x_BTD, None)
    return {**stats, "logits_max": max_BT, "logits_lse": lse_BT}


def activation_stats(graphdef, params, frozen, batch: dict, micro_batches: int = 1) -> dict[str, jax.Array]:
    """The statistics of the module docstring for the model `nnx.merge(graphdef, params, frozen)` (with LoRA:
    the adapted model; an actor-critic: its policy) on `batch` (a train batch: `tokens`, and `segment_ids` and
    `positions` when packed). Traceable: jit it, under the training mesh, as the diagnostic variant of a step.

    `micro_batches` (dividing the batch's rows) runs the batch in that many slices of rows one after the other
    (as `train.grad_accum` does), so its activations take no more memory than a training micro-batch's forward
    pass; the statistics are of the whole batch either way. Dropout is off: the statistics are deterministic.
    """
    model = nnx.merge(graphdef, params, frozen)
    tokens_BT = batch["tokens"]
    segment_ids_BT = batch.get("segment_ids")
    positions_BT = batch.get("positions")
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones_like(tokens_BT)
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    rows = tuple(split_microbatches(a, micro_batches) for a in (tokens_BT, segment_ids_BT, positions_BT))
    per_micro = jax.lax.map(lambda mb: _per_token_stats(model, *mb), rows)
    # Reductions ignore row order: stack the micro-batches' rows back into one batch axis ([L, B, T], [B, T]).
    per_token = {name: _join_rows(a, layered=name not in ("logits_max", "logits_lse"))
                 for name, a in per_micro.items()}
    valid_BT = _join_rows(rows[1], layered=False) > 0
    cfg = model.cfg
    return {**_layer_stats(per_token, valid_BT, cfg.dim, cfg.mlp_dim, cfg.head_dim), **_head_stats(per_token, valid_BT)}


def _join_rows(a: jax.Array, layered: bool) -> jax.Array:
    """[A, (L,) B/A, T] -> [(L,) B, T]."""
    if layered:
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape((a.shape[0], a.shape[1] * a.shape[2]) + a.shape[3:])
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _valid_sum(a, valid_BT):
    return jnp.sum(jnp.where(valid_BT, a, 0.0), axis=(-2, -1))


def _valid_max(a, valid_BT):
    return jnp.max(jnp.where(valid_BT, a, -jnp.inf), axis=(-2, -1))


def _layer_stats(t: dict, valid_BT, dim: int, mlp_dim: int, head_dim: int) -> dict:
    """The [L] statistics from the probes' per-token ones; NaN for a layer non-finite anywhere in the batch."""
    count = jnp.maximum(jnp.sum(valid_BT), 1).astype(jnp.float32)
    if "attn_logit_max" in t:
        logit_max_L = _valid_max(t["attn_logit_max"], valid_BT)
    else:  # cuDNN: |q.k| <= ||q|| ||k||
        logit_max_L = _valid_max(t["q_norm"], valid_BT) * _valid_max(t["k_norm"], valid_BT) * head_dim**-0.5
    poison_L = jnp.where(jnp.all(t["finite"], axis=(1, 2)), 0.0, jnp.nan)
    stats = {
        "act_rms": jnp.sqrt(_valid_sum(t["sq_sum"], valid_BT) / (count * dim)),
        "act_max": _valid_max(t["abs_max"], valid_BT),
        "gate_saturation": _valid_sum(t["gate_saturated"], valid_BT) / (count * mlp_dim),
        "attn_logit_max": logit_max_L,
    }
    return {name: value + poison_L for name, value in stats.items()}


def _head_stats(t: dict, valid_BT) -> dict:
    """logits_max and logits_lse_mean over valid tokens (NaN when any token's logits are non-finite)."""
    if "logits_max" not in t:
        return {}
    count = jnp.maximum(jnp.sum(valid_BT), 1).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(t["logits_max"]) & jnp.isfinite(t["logits_lse"]))
    poison = jnp.where(finite, 0.0, jnp.nan)
    return {"logits_max": _valid_max(t["logits_max"], valid_BT) + poison,
            "logits_lse_mean": _valid_sum(t["logits_lse"], valid_BT) / count + poison}


def first_nonfinite_layer(stats: dict) -> int | None:
    """The index of the first layer whose statistics (`activation_stats`' per-layer entries, fetched or not) are
    non-finite, or None when every layer is finite."""
    finite_L = np.all([np.isfinite(np.asarray(stats[name])) for name in PER_LAYER if name in stats], axis=0)
    bad = np.flatnonzero(~finite_L)
    return int(bad[0]) if bad.size else None
