"""Per-token statistics of the output head, log p(target) and the entropy, over the whole sequence at once or
chunk by chunk, and the next-token loss built on them (pretraining's, held-out perplexity's, SFT's).

With `model.loss_chunk` = C > 0, the head matmul, log-sum-exp and target logit run over C sequence positions
at a time inside a `lax.scan`, each chunk under `jax.checkpoint`. A chunk's [B, C, V] logits are the only ones
that exist at any moment: the forward keeps its per-token results, and the backward recomputes one chunk's
logits to get its gradient. At V = 128k and T = 4096 the full float32 logits of one row are 2 GiB, larger
than the rest of a small model's step. The chunks run along the sequence, so the batch keeps its data/fsdp
sharding and the vocabulary its `tensor` split: the target logit stays a one-hot product, with no gather
across devices. The arithmetic per token is that of the unchunked path, so the two agree to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.moe import gradient_only, router_penalty
from jaxllm.model.numerics import widened


def token_logps(logits_BTV, targets_BT):
    """log p(target) at every position [B, T], in float32.

    The target logit is picked with a one-hot product rather than a gather: with the vocabulary split over
    `tensor`, that is an elementwise product and a sharded reduction, with no gather across devices. No
    [B, T, V] log-softmax is kept: the logsumexp reduces it at once.
    """
    logits_BTV = widened(logits_BTV)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.sum(logits_BTV * jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype), -1)
    return target_logit_BT - lse_BT


def token_entropy(logits_BTV):
    """Entropy [B, T] of each position's distribution softmax(logits), float32: logsumexp - E_p[logit]."""
    logits_BTV = widened(logits_BTV)
    probs_BTV = jax.nn.softmax(logits_BTV, axis=-1)
    return jax.nn.logsumexp(logits_BTV, axis=-1) - jnp.sum(probs_BTV * logits_BTV, axis=-1)


def head_stats(model, x_BTD, targets_BT, *, temperature: float = 1.0, entropy: bool = False):
    """(log p(target) [B, T], entropy [B, T] or None) under softmax(logits / temperature) of `model`'s head
    (a `Transformer`: its `logits` and `cfg.loss_chunk`) over final hidden states `x_BTD`, in float32."""

    def stats(x_BCD, targets_BC):
        logits_BCV = widened(model.logits(x_BCD))
        if temperature != 1.0:
            logits_BCV = logits_BCV / temperature
        logps_BC = token_logps(logits_BCV, targets_BC)
        return (logps_BC, token_entropy(logits_BCV)) if entropy else (logps_BC,)

    T = targets_BT.shape[1]
    chunk = model.cfg.loss_chunk
    if not chunk or chunk >= T:
        out = stats(x_BTD, targets_BT)
    else:
        out = chunked(stats, x_BTD, targets_BT, chunk)
    return out[0], out[1] if entropy else None


def chunked(stats, x_BTD, targets_BT, chunk: int):
    """`stats` over the sequence in chunks of `chunk` positions (the last one padded), scanned with remat."""
    B, T, D = x_BTD.shape
    n = -(-T // chunk)
    pad = n * chunk - T
    x_nBCD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
    targets_nBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
    body = jax.checkpoint(lambda _, xs: (None, stats(*xs)), prevent_cse=False)
    _, out = jax.lax.scan(body, None, (x_nBCD, targets_nBC))
    return tuple(o_nBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :T] for o_nBC in out)


def cross_entropy_sum(model, batch, mask_BT, rng=None):
    """(sum of the token losses of `batch["targets"]` where `mask_BT` is 1, number of counted tokens, metrics),
    float32; the head runs chunk by chunk when `model.loss_chunk` is set (jaxllm/model/head.py). A mixture of
    experts' auxiliary losses (`jaxllm.model.moe.router_penalty`, per counted token) enter the sum's gradient
    only, and their values the metrics."""
    x_BTD, router = model.hidden_states_and_router(batch["tokens"], batch["segment_ids"], batch["positions"], rng)
    logps_BT, _ = head_stats(model, x_BTD, batch["targets"])
    mask_BT = mask_BT.astype(jnp.float32)
    loss_sum, count = -jnp.sum(logps_BT * mask_BT), jnp.sum(mask_BT)
    loss_sum, metrics = with_router_penalty(model, loss_sum, count, router)
    return loss_sum, count, metrics


def with_router_penalty(model, loss_sum, count, router):
    """(`loss_sum` whose gradient also carries a mixture of experts' auxiliary losses, their metrics) for any
    objective's `loss_fn`: the penalty (`jaxllm.model.moe.router_penalty` of the trained forward's router sums
    `router`) enters once per `count`, so the mean the step takes gains it once, as transformers and TRL add
    `router_aux_loss_coef` times the aux loss to the mean loss; the reported loss stays the objective's own. A
    dense model (`router` None) changes nothing."""
    if router is None:  # a dense model: the traced program is exactly the plain loss's
        return loss_sum, {}
    penalty, metrics = router_penalty(model.cfg, router)
    return gradient_only(loss_sum, penalty * count), metrics


def next_token_loss(model, batch, rng=None):
    """`loss_fn` of language modelling: summed cross-entropy over the masked targets of packed rows."""
    return cross_entropy_sum(model, batch, batch["loss_mask"], rng)
