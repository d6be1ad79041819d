"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks the top k of E experts for each token,
each expert is a gated MLP, and a token's output is its experts' outputs weighted by the router.

Routing, as transformers computes it: router logits = x @ router [T, E]; probabilities = softmax in float32; the
top k of them (ties to the lower expert index, as `torch.topk` and `jax.lax.top_k` both break them), renormalised
to sum to 1 when `renormalize` (Mixtral always; Qwen3-MoE's `norm_topk_prob`).

Dispatch is dropless: the T * k (token, expert) pairs are sorted by expert, so each expert's tokens form one
contiguous group, one grouped matmul per projection (`jax.lax.ragged_dot`) runs every expert over its own group
only, and the outputs are added back to their tokens weighted by the router. No token is dropped and no expert
computes tokens it was not routed (a dense formulation would run all E experts on every token). The capacity
dispatch (`capacity_experts`) is the fallback with static shapes: fixed-size expert buffers, overflow dropped and
counted.

The auxiliary load-balancing loss (Switch Transformer eq. 4-6, transformers' `load_balancing_loss_func`):
E * sum_e f_e * P_e over the layers' tokens taken together, f_e the fraction of top-k picks that chose expert e
and P_e the mean router probability of e.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.layers import ACTIVATIONS, param


class Routing(NamedTuple):
    """What the router decided for T tokens: its logits [T, E] (float32), the top-k experts [T, K] and their
    weights [T, K] (float32)."""

    logits: jax.Array
    experts: jax.Array
    weights: jax.Array


def route(x_TD: jax.Array, router_DE: jax.Array, top_k: int, renormalize: bool) -> Routing:
    """The top `top_k` experts of each token and their weights (see the module docstring)."""
    logits_TE = jnp.einsum("TD,DE->TE", x_TD, router_DE.astype(x_TD.dtype)).astype(jnp.float32)
    weights_TK, experts_TK = jax.lax.top_k(jax.nn.softmax(logits_TE, axis=-1), top_k)
    if renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return Routing(logits_TE, experts_TK, weights_TK)


def dropless_experts(x_TD: jax.Array, routing: Routing, gate_EDF, up_EDF, down_EFD, activation: str) -> jax.Array:
    """Each token's routed experts' outputs, weighted by the router and summed [T, D]: the (token, expert) pairs
    sorted by expert and run as ragged groups, one grouped matmul per projection."""
    T, K = routing.experts.shape
    E = gate_EDF.shape[0]
    experts_P = routing.experts.reshape(T * K)  # pair p = token p // K, its (p % K)-th pick
    order_P = jnp.argsort(experts_P, stable=True)  # pairs grouped by expert, tokens in order within a group
    tokens_P = order_P // K
    group_sizes_E = jnp.bincount(experts_P, length=E).astype(jnp.int32)
    x_PD = x_TD[tokens_P]
    gate_PF = jax.lax.ragged_dot(x_PD, gate_EDF.astype(x_TD.dtype), group_sizes_E)
    up_PF = jax.lax.ragged_dot(x_PD, up_EDF.astype(x_TD.dtype), group_sizes_E)
    out_PD = jax.lax.ragged_dot(ACTIVATIONS[activation](gate_PF) * up_PF, down_EFD.astype(x_TD.dtype), group_sizes_E)
    weights_P = routing.weights.reshape(T * K)[order_P].astype(out_PD.dtype)
    return jnp.zeros_like(x_TD).at[tokens_P].add(out_PD * weights_P[:, None])


def capacity_experts(x_TD: jax.Array, routing: Routing, gate_EDF, up_EDF, down_EFD, activation: str,
                     capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """`dropless_experts` with fixed-size expert buffers: (outputs [T, D], the number of dropped (token, expert)
    pairs). Each expert takes at most C = ceil(capacity_factor * T * K / E) pairs, first choices before second
    ones (then in token order), so under pressure a token keeps its first choice before another token's second;
    a pair past its expert's capacity is dropped (that expert adds nothing to the token). The fallback where a
    ragged kernel is slow or missing: every shape is static."""
    T, K = routing.experts.shape
    E = gate_EDF.shape[0]
    C = capacity(T, K, E, capacity_factor)
    experts_P = routing.experts.T.reshape(K * T)  # pair p = pick p // T of token p % T: first choices first
    onehot_PE = jax.nn.one_hot(experts_P, E, dtype=jnp.int32)
    slot_P = jnp.sum((jnp.cumsum(onehot_PE, axis=0) - 1) * onehot_PE, axis=1)  # the pair's place in its expert
    kept_P = slot_P < C
    tokens_P = jnp.tile(jnp.arange(T), K)
    # Dropped pairs write to (and read from) a spare slot C that no expert output is taken from.
    slot_P = jnp.where(kept_P, slot_P, C)
    buffer_ECD = jnp.zeros((E, C + 1, x_TD.shape[1]), x_TD.dtype).at[experts_P, slot_P].set(x_TD[tokens_P])
    gate_EDF, up_EDF, down_EFD = (w.astype(x_TD.dtype) for w in (gate_EDF, up_EDF, down_EFD))
    h_ECF = (ACTIVATIONS[activation](jnp.einsum("ECD,EDF->ECF", buffer_ECD, gate_EDF))
             * jnp.einsum("ECD,EDF->ECF", buffer_ECD, up_EDF))
    out_ECD = jnp.einsum("ECF,EFD->ECD", h_ECF, down_EFD)
    weights_P = jnp.where(kept_P, routing.weights.T.reshape(K * T), 0.0).astype(out_ECD.dtype)
    out_TD = jnp.zeros_like(x_TD).at[tokens_P].add(out_ECD[experts_P, slot_P] * weights_P[:, None])
    return out_TD, jnp.sum(~kept_P)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert's buffer holds: capacity_factor times an even share of the tokens' top-k picks."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def routing_stats(routing: Routing, num_experts: int) -> dict[str, jax.Array]:
    """What a layer's router did with its T tokens (device scalars, for metrics): the tokens each expert got
    (`expert_tokens_min`, `_max`, and `_cv`, their coefficient of variation: 0 when even, high when a few experts
    take most tokens) and `router_entropy`, the mean entropy of the router's probabilities in nats (log E when
    undecided, 0 when certain)."""
    counts_E = jnp.bincount(routing.experts.reshape(-1), length=num_experts).astype(jnp.float32)
    probs_TE = jax.nn.softmax(routing.logits, axis=-1)
    entropy_T = -jnp.sum(probs_TE * jax.nn.log_softmax(routing.logits, axis=-1), axis=-1)
    return {"expert_tokens_min": jnp.min(counts_E), "expert_tokens_max": jnp.max(counts_E),
            "expert_tokens_cv": jnp.std(counts_E) / jnp.mean(counts_E), "router_entropy": jnp.mean(entropy_T)}


def router_z_loss(logits_TE: jax.Array) -> jax.Array:
    """The router z-loss (ST-MoE, Zoph et al. 2022): the mean over tokens of logsumexp(router logits)^2, which keeps
    the logits small."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)))


def load_balancing_loss(logits_LTE: jax.Array, top_k: int, mask_T: jax.Array | None = None) -> jax.Array:
    """The auxiliary load-balancing loss of the router logits of L layers [L, T, E] (see the module docstring);
    `mask_T` (1: a real token) leaves padding out, as transformers' `attention_mask` does."""
    L, T, E = logits_LTE.shape
    probs_LTE = jax.nn.softmax(logits_LTE.astype(jnp.float32), axis=-1)
    _, experts_LTK = jax.lax.top_k(probs_LTE, top_k)
    mask_LT = jnp.ones((L, T), jnp.float32) if mask_T is None else jnp.broadcast_to(mask_T.astype(jnp.float32), (L, T))
    picks_E = jnp.sum(jax.nn.one_hot(experts_LTK, E, dtype=jnp.float32) * mask_LT[..., None, None], axis=(0, 1, 2))
    rows = jnp.sum(mask_LT)
    tokens_per_expert_E = picks_E / rows  # transformers divides the picks by the rows, not by rows * k
    probability_per_expert_E = jnp.sum(probs_LTE * mask_LT[..., None], axis=(0, 1)) / rows
    return E * jnp.sum(tokens_per_expert_E * probability_per_expert_E)


class MoEMLP(nnx.Module):
    """The mixture-of-experts feed-forward of one layer (or a stack of them, `stack`): a router [D, E] and E gated
    experts [E, D, F] / [E, F, D] with the family's activation. Its call returns the output and the router's
    logits, from which the load-balancing loss is taken."""

    def __init__(self, dim: int, mlp_dim: int, num_experts: int, top_k: int, *, renormalize: bool, activation: str,
                 init_std: float, out_std: float, dtype, rngs: nnx.Rngs, stack: tuple = ()):
        D, F, E = dim, mlp_dim, num_experts
        lead = ("layers",) * len(stack)
        self.router = param(rngs, stack + (D, E), lead + ("embed", "expert"), dtype, init_std)
        self.gate_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.up_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.down_proj = param(rngs, stack + (E, F, D), lead + ("expert", "mlp", "embed"), dtype, out_std)
        self.top_k, self.renormalize, self.activation = top_k, renormalize, activation  # static

    def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(output [B, T, D], router logits [B * T, E] in float32)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        routing = route(x_ND, self.router[...], self.top_k, self.renormalize)
        out_ND = dropless_experts(x_ND, routing, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                                  self.activation)
        return out_ND.reshape(B, T, D), routing.logits
