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
    """`dropless_experts` with fixed-size expert buffers: (outputs [T, D], which (pick, token) pairs were kept
    [K, T]). Each expert takes at most C = ceil(capacity_factor * T * K / E) pairs, first choices before second
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
    return out_TD, kept_P.reshape(K, T)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Pairs one expert's buffer holds: capacity_factor times an even share of the tokens' top-k picks."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


class RouterSums(NamedTuple):
    """What one layer's router did with each row's tokens, as sums over the row (float32): `picks` [B, E] how many
    of its tokens' top-k picks chose each expert, `probs` [B, E] the router probabilities summed over its tokens,
    `z` [B] the tokens' squared logsumexp of the router logits, `entropy` [B] the router's entropy in nats, and
    `dropped` [B] the picks that capacity dispatch dropped. Sums add over rows, micro-batches, data shards and
    layers, so the losses and metrics below come out the same however the batch was split."""

    picks: jax.Array
    probs: jax.Array
    z: jax.Array
    entropy: jax.Array
    dropped: jax.Array


def router_sums(routing: Routing, rows: int, num_experts: int, kept_KT: jax.Array | None = None) -> RouterSums:
    """`RouterSums` of the routing of `rows` rows' tokens (flattened row by row); `kept_KT` from capacity
    dispatch (None: nothing dropped)."""
    logits_BTE = routing.logits.reshape(rows, -1, num_experts)
    experts_BTK = routing.experts.reshape(rows, -1, routing.experts.shape[-1])
    picks_BE = jnp.sum(jax.nn.one_hot(experts_BTK, num_experts, dtype=jnp.float32), axis=(1, 2))
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    lse_BT = jax.nn.logsumexp(logits_BTE, axis=-1)
    entropy_BT = -jnp.sum(probs_BTE * jax.nn.log_softmax(logits_BTE, axis=-1), axis=-1)
    dropped = jnp.zeros((rows,), jnp.float32) if kept_KT is None else jnp.sum(
        ~kept_KT.reshape(kept_KT.shape[0], rows, -1), axis=(0, 2)).astype(jnp.float32)
    return RouterSums(picks_BE, jnp.sum(probs_BTE, axis=1), jnp.sum(jnp.square(lse_BT), axis=1),
                      jnp.sum(entropy_BT, axis=1), dropped)


def router_losses(sums: RouterSums, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) of the router sums of any number of leading axes (layers, rows) taken
    together: the load-balancing loss of the layers' tokens concatenated, as transformers computes it for the
    router logits of all layers (`load_balancing_loss` on the logits), and the mean z-loss over the same tokens."""
    E = sums.picks.shape[-1]
    tokens = jnp.sum(sums.picks) / top_k  # (layer, token) rows
    picks_E = jnp.sum(sums.picks.reshape(-1, E), axis=0)
    probs_E = jnp.sum(sums.probs.reshape(-1, E), axis=0)
    return E * jnp.sum(picks_E * probs_E) / tokens**2, jnp.sum(sums.z) / tokens


def router_metrics(sums_L: RouterSums, top_k: int) -> dict[str, jax.Array]:
    """Per-layer router statistics [L] from router sums [L, B, ...] (device arrays, for metrics): the tokens each
    expert got (`expert_tokens_min`, `_max`, and `_cv`, their coefficient of variation: 0 when even, high when a
    few experts take most tokens), `router_entropy` (the mean entropy of the router's probabilities in nats: log E
    when undecided, 0 when certain) and `moe_dropped_fraction` (of the picks, in capacity dispatch)."""
    counts_LE = jnp.sum(sums_L.picks, axis=1)
    picks_L = jnp.sum(counts_LE, axis=-1)
    return {"expert_tokens_min": jnp.min(counts_LE, axis=-1), "expert_tokens_max": jnp.max(counts_LE, axis=-1),
            "expert_tokens_cv": jnp.std(counts_LE, axis=-1) / jnp.mean(counts_LE, axis=-1),
            "router_entropy": jnp.sum(sums_L.entropy, axis=1) / (picks_L / top_k),
            "moe_dropped_fraction": jnp.sum(sums_L.dropped, axis=1) / picks_L}


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


def router_penalty(cfg, sums_L: RouterSums | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the auxiliary loss the training loss adds, metrics) of a model config `cfg` (jaxllm.config.schema.
    ModelConfig) from its layers' router sums [L, B, ...]: `moe_aux_loss_coef` times the load-balancing loss plus
    `moe_z_loss_coef` times the z-loss; the metrics are the two losses and `moe/<stat>/layer_<i>` per layer
    (`router_metrics`). (0, {}) for a dense model (`sums_L` None)."""
    if sums_L is None:
        return jnp.zeros((), jnp.float32), {}
    aux, z = router_losses(sums_L, cfg.experts_per_token)
    per_layer = router_metrics(sums_L, cfg.experts_per_token)
    metrics = {f"moe/{name}/layer_{i}": v[i] for name, v in per_layer.items() for i in range(v.shape[0])}
    return cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z, {"moe_aux_loss": aux, "moe_z_loss": z, **metrics}


def gradient_only(value: jax.Array, penalty: jax.Array) -> jax.Array:
    """`value` whose gradient also carries `penalty`'s: the auxiliary losses train the router without entering
    the reported or held-out loss."""
    return value + (penalty - jax.lax.stop_gradient(penalty))


class MoEMLP(nnx.Module):
    """The mixture-of-experts feed-forward of one layer (or a stack of them, `stack`): a router [D, E] and E gated
    experts [E, D, F] / [E, F, D] with the family's activation. Its call returns the output and the router's
    `RouterSums` per row, from which the auxiliary losses and the metrics are taken."""

    def __init__(self, dim: int, mlp_dim: int, num_experts: int, top_k: int, *, renormalize: bool, activation: str,
                 init_std: float, out_std: float, dtype, rngs: nnx.Rngs, stack: tuple = (),
                 dispatch: str = "dropless", capacity_factor: float = 1.0):
        D, F, E = dim, mlp_dim, num_experts
        lead = ("layers",) * len(stack)
        self.router = param(rngs, stack + (D, E), lead + ("embed", "expert"), dtype, init_std)
        self.gate_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.up_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.down_proj = param(rngs, stack + (E, F, D), lead + ("expert", "mlp", "embed"), dtype, out_std)
        self.top_k, self.renormalize, self.activation = top_k, renormalize, activation  # static
        self.dispatch, self.capacity_factor = dispatch, capacity_factor  # static

    def __call__(self, x_BTD: jax.Array, dropless: bool = False) -> tuple[jax.Array, RouterSums]:
        """(output [B, T, D], the router's sums per row); `dropless` overrides a capacity dispatch (decoding)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        routing = route(x_ND, self.router[...], self.top_k, self.renormalize)
        experts = (self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.activation)
        kept_KN = None
        if self.dispatch == "capacity" and not dropless:
            out_ND, kept_KN = capacity_experts(x_ND, routing, *experts, self.capacity_factor)
        else:
            out_ND = dropless_experts(x_ND, routing, *experts)
        return out_ND.reshape(B, T, D), router_sums(routing, B, self.router.shape[-1], kept_KN)
