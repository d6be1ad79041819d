"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the top k of E experts for each
token, each expert is a gated MLP, and a token's output is its experts' outputs weighted by the router; plus, with
a shared expert (Qwen2-MoE), a gated MLP every token runs, scaled by sigmoid(x @ shared_expert_gate).

Routing, as transformers computes it: router logits = x @ router [T, E]; probabilities = softmax in float32
(float64 in a float64 run: jaxllm/model/numerics.py); the top k of them (ties to the lower expert index, as
`torch.topk` and `jax.lax.top_k` both break them), renormalised to sum to 1 when `renormalize` (Mixtral always; the
Qwens' `norm_topk_prob`). With sigmoid scores (DeepSeek-V3) each expert's score is sigmoid(logit) on its own. With
a `RouterBias` (DeepSeek-V3's auxiliary-loss-free balancing) the experts are chosen by score + bias and weighted by
their scores alone; the train step moves the bias against each expert's load (`balance_router_bias`).

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

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model.layers import ACTIVATIONS, gated_mlp, param
from jaxllm.model.lora import project
from jaxllm.model.numerics import widened
from jaxllm.model.quant import expert_ragged_dot
from jaxllm.parallel.experts import ExpertGroup, run_experts


EXPERT_LOAD = "moe_expert_load"  # the loss_fn metric of the picks per layer and expert [L, E] (`balance_router_bias`)


class RouterBias(nnx.Param):
    """A per-expert routing bias [..., E] (DeepSeek-V3's auxiliary-loss-free balancing, float32), trained by no
    gradient (it only chooses experts) and left alone by the optimizer (no weight decay: jaxllm.optim.chain.
    decay_mask); the train step adds `update_rate` (its metadata) times sign(mean load - load) after each update.
    A parameter, so it lives in the train state and its checkpoints and follows the parameters' layouts."""


class Routing(NamedTuple):
    """What the router decided for T tokens: its logits [T, E] (float32), the top-k experts [T, K], their
    weights [T, K] (float32) and the router's probabilities over the experts [T, E] (float32: the softmax, or the
    sigmoid scores divided by their sum; the auxiliary losses' P_e and the entropy); float64 in a float64 run.
    The picks alone, as the expert exchange moves them, have no logits and probabilities (None)."""

    logits: jax.Array
    experts: jax.Array
    weights: jax.Array
    probs: jax.Array | None = None


def route(x_TD: jax.Array, router_DE: jax.Array, top_k: int, renormalize: bool, scores: str = "softmax",
          bias_E: jax.Array | None = None) -> Routing:
    """The top `top_k` experts of each token and their weights, by softmax or sigmoid `scores`, chosen by score +
    `bias_E` when there is one (see the module docstring)."""
    logits_TE = widened(jnp.einsum("TD,DE->TE", x_TD, router_DE.astype(x_TD.dtype)))
    if scores == "softmax":
        scores_TE = probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    if bias_E is None:
        weights_TK, experts_TK = jax.lax.top_k(scores_TE, top_k)
    else:  # the bias chooses, the scores weigh; no gradient reaches the bias through the choice
        _, experts_TK = jax.lax.top_k(scores_TE + jax.lax.stop_gradient(bias_E.astype(scores_TE.dtype)), top_k)
        weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return Routing(logits_TE, experts_TK, weights_TK, probs_TE)


def balance_router_bias(params, load):
    """`params` (an nnx.State) with every `RouterBias` b moved by its update rate times sign(mean_e load - load)
    per layer: an expert that took more than an even share of the picks is chosen less next step, one that took
    fewer more (DeepSeek-V3, eq. 16's surroundings). `load` is the picks per layer and expert [L, E] (the loss_fn's
    `EXPERT_LOAD`), in the global layer order the bias's stacked axes flatten to."""
    def move(var):
        if not isinstance(var, RouterBias):
            return var
        bias = var[...]
        load_E = load.reshape(bias.shape).astype(jnp.float32)
        direction = jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E)
        return var.replace(bias + var.get_metadata()["update_rate"] * direction)

    return jax.tree.map(move, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def grouped_experts(x_PD: jax.Array, gate_EDF, up_EDF, down_EFD, activation: str, group_sizes_E,
                    quant: str = "none", row_axes: tuple[str, ...] = ()) -> jax.Array:
    """Each expert's gated MLP over its group of rows [P, D] (the rows grouped by expert, `group_sizes_E` of
    them each; rows past the groups are padding): one grouped matmul per projection, quantised as `quant` says
    (`row_axes`: the mesh axes the batch's other rows are on, jaxllm.model.quant.expert_ragged_dot)."""
    matmul = lambda x, w: expert_ragged_dot(x, w, group_sizes_E, quant, row_axes)
    # Named as the dense MLP's (jaxllm/model/layers.py), so the remat policies that keep them keep these too.
    gate_PF = checkpoint_name(matmul(x_PD, gate_EDF), "mlp_gate")
    up_PF = checkpoint_name(matmul(x_PD, up_EDF), "mlp_up")
    return matmul(ACTIVATIONS[activation](gate_PF) * up_PF, down_EFD)


def dropless_experts(x_TD: jax.Array, routing: Routing, gate_EDF, up_EDF, down_EFD, activation: str,
                     first_expert=0, num_experts: int | None = None, quant: str = "none",
                     row_axes: tuple[str, ...] = ()) -> jax.Array:
    """Each token's routed experts' outputs, weighted by the router and summed [T, D]: the (token, expert) pairs
    sorted by expert and run as ragged groups, one grouped matmul per projection.

    The weights may be a window of the experts (expert parallelism, jaxllm/parallel/experts.py): experts
    [first_expert, first_expert + E_local) of `num_experts`; the tokens' other picks add nothing here (their
    experts' devices add them). `quant`, `row_axes`: as `grouped_experts`'."""
    T, K = routing.experts.shape
    E_local = gate_EDF.shape[0]
    E = num_experts or E_local
    P = T * K
    experts_P = routing.experts.reshape(P)  # pair p = token p // K, its (p % K)-th pick
    order_P = jnp.argsort(experts_P, stable=True)  # pairs grouped by expert, tokens in order within a group
    group_sizes_E = jnp.bincount(experts_P, length=E).astype(jnp.int32)
    # The window's pairs are contiguous in expert order: rotate them to the front.
    start = jnp.sum(jnp.where(jnp.arange(E) < first_expert, group_sizes_E, 0))
    local_sizes = jax.lax.dynamic_slice(group_sizes_E, (first_expert,), (E_local,))
    pairs_P = order_P[(start + jnp.arange(P)) % P]
    tokens_P = pairs_P // K
    out_PD = grouped_experts(x_TD[tokens_P], gate_EDF, up_EDF, down_EFD, activation, local_sizes, quant, row_axes)
    in_window_P = jnp.arange(P) < jnp.sum(local_sizes)  # rows past the window's groups: other devices' experts
    weights_P = jnp.where(in_window_P, routing.weights.reshape(P)[pairs_P], 0.0).astype(out_PD.dtype)
    return jnp.zeros_like(x_TD).at[tokens_P].add(out_PD * weights_P[:, None])


def expert_slots(experts_BTK: jax.Array, num_experts: int, capacity_per_row: int) -> tuple[jax.Array, jax.Array]:
    """(each pick's place in its expert's buffer for its row, whether it fits) [B, K, T]: within a row, first
    choices before second ones, then in token order, each expert taking at most `capacity_per_row` picks."""
    B, T, K = experts_BTK.shape
    experts_BP = jnp.swapaxes(experts_BTK, 1, 2).reshape(B, K * T)  # pick-major: first choices first
    onehot_BPE = jax.nn.one_hot(experts_BP, num_experts, dtype=jnp.int32)
    slot_BP = jnp.sum((jnp.cumsum(onehot_BPE, axis=1) - 1) * onehot_BPE, axis=2)
    return slot_BP.reshape(B, K, T), (slot_BP < capacity_per_row).reshape(B, K, T)


def capacity_experts(x_TD: jax.Array, routing: Routing, gate_EDF, up_EDF, down_EFD, activation: str,
                     capacity_factor: float, rows: int = 1, first_expert=0, num_experts: int | None = None,
                     quant: str = "none", row_axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """`dropless_experts` with fixed-size expert buffers: (outputs [T, D], which picks were kept [rows, K, T /
    rows]). The T tokens are `rows` rows; in each row an expert takes at most C = ceil(capacity_factor * T_row * K
    / E) picks (`expert_slots`: a token keeps its first choice before another token's second), and a pick past
    its expert's capacity is dropped (that expert adds nothing to the token). Capacity per row, not per batch,
    so what is dropped does not depend on how the batch is split over devices. The fallback where a ragged kernel
    is slow or missing: every shape is static. Expert window as `dropless_experts`. Quantised (`quant`), the
    buffers run as `grouped_experts`' equal groups, so both dispatches quantise alike."""
    T, K = routing.experts.shape
    E_local, D = gate_EDF.shape[0], x_TD.shape[1]
    E, T_row = num_experts or E_local, T // rows
    C = capacity(T_row, K, E, capacity_factor)
    slot_BKT, kept_BKT = expert_slots(routing.experts.reshape(rows, T_row, K), E, C)
    local_BKT = jnp.swapaxes(routing.experts.reshape(rows, T_row, K), 1, 2) - first_expert
    taken_BKT = kept_BKT & (local_BKT >= 0) & (local_BKT < E_local)
    # Buffer row b * C + slot of the pick's expert; picks not taken here go to a spare last row no output reads.
    place_BKT = jnp.where(taken_BKT, jnp.arange(rows)[:, None, None] * C + slot_BKT, rows * C)
    expert_BKT = jnp.clip(local_BKT, 0, E_local - 1)
    tokens_BKT = jnp.broadcast_to((jnp.arange(rows)[:, None] * T_row + jnp.arange(T_row))[:, None, :], (rows, K, T_row))
    buffer_ECD = jnp.zeros((E_local, rows * C + 1, D), x_TD.dtype).at[expert_BKT, place_BKT].set(x_TD[tokens_BKT])
    out_ECD = _buffered_experts(buffer_ECD, gate_EDF, up_EDF, down_EFD, activation, quant, row_axes)
    weights_BKT = jnp.swapaxes(routing.weights.reshape(rows, T_row, K), 1, 2)
    weights_BKT = jnp.where(taken_BKT, weights_BKT, 0.0).astype(out_ECD.dtype)
    out_TD = jnp.zeros_like(x_TD).at[tokens_BKT].add(out_ECD[expert_BKT, place_BKT] * weights_BKT[..., None])
    return out_TD, kept_BKT


def _buffered_experts(buffer_ECD, gate_EDF, up_EDF, down_EFD, activation: str, quant: str, row_axes) -> jax.Array:
    """Each expert's gated MLP over its buffer [E, C, D]."""
    if quant != "none":
        E, C, D = buffer_ECD.shape
        sizes_E = jnp.full((E,), C, jnp.int32)
        return grouped_experts(buffer_ECD.reshape(E * C, D), gate_EDF, up_EDF, down_EFD, activation, sizes_E, quant,
                               row_axes).reshape(E, C, D)
    gate_EDF, up_EDF, down_EFD = (w.astype(buffer_ECD.dtype) for w in (gate_EDF, up_EDF, down_EFD))
    h_ECF = (ACTIVATIONS[activation](checkpoint_name(jnp.einsum("ECD,EDF->ECF", buffer_ECD, gate_EDF), "mlp_gate"))
             * checkpoint_name(jnp.einsum("ECD,EDF->ECF", buffer_ECD, up_EDF), "mlp_up"))
    return jnp.einsum("ECF,EFD->ECD", h_ECF, down_EFD)


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


def router_sums(routing: Routing, rows: int, num_experts: int, kept_BKT: jax.Array | None = None) -> RouterSums:
    """`RouterSums` of the routing of `rows` rows' tokens (flattened row by row); `kept_BKT` from capacity
    dispatch (None: nothing dropped)."""
    logits_BTE = routing.logits.reshape(rows, -1, num_experts)
    experts_BTK = routing.experts.reshape(rows, -1, routing.experts.shape[-1])
    picks_BE = jnp.sum(jax.nn.one_hot(experts_BTK, num_experts, dtype=jnp.float32), axis=(1, 2))
    lse_BT = jax.nn.logsumexp(logits_BTE, axis=-1)
    probs_BTE = routing.probs.reshape(rows, -1, num_experts)
    entropy_BT = -jnp.sum(jax.scipy.special.xlogy(probs_BTE, probs_BTE), axis=-1)
    dropped = jnp.zeros((rows,), jnp.float32) if kept_BKT is None else jnp.sum(~kept_BKT, axis=(1, 2)).astype(
        jnp.float32)
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
    when undecided, 0 when certain), `moe_dropped_fraction` (of the picks, in capacity dispatch) and
    `expert_top_share`, the share of the picks the busiest top_k experts took (top_k / E when even, 1 when every
    token picks the same experts)."""
    counts_LE = jnp.sum(sums_L.picks, axis=1)
    picks_L = jnp.sum(counts_LE, axis=-1)
    busiest_LK = jax.lax.top_k(counts_LE, top_k)[0]
    return {"expert_tokens_min": jnp.min(counts_LE, axis=-1), "expert_tokens_max": jnp.max(counts_LE, axis=-1),
            "expert_tokens_cv": jnp.std(counts_LE, axis=-1) / jnp.mean(counts_LE, axis=-1),
            "expert_top_share": jnp.sum(busiest_LK, axis=-1) / picks_L,
            "router_entropy": jnp.sum(sums_L.entropy, axis=1) / (picks_L / top_k),
            "moe_dropped_fraction": jnp.sum(sums_L.dropped, axis=1) / picks_L}


def router_z_loss(logits_TE: jax.Array) -> jax.Array:
    """The router z-loss (ST-MoE, Zoph et al. 2022): the mean over tokens of logsumexp(router logits)^2, which keeps
    the logits small."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(widened(logits_TE), axis=-1)))


def load_balancing_loss(logits_LTE: jax.Array, top_k: int, mask_T: jax.Array | None = None) -> jax.Array:
    """The auxiliary load-balancing loss of the router logits of L layers [L, T, E] (see the module docstring);
    `mask_T` (1: a real token) leaves padding out, as transformers' `attention_mask` does."""
    L, T, E = logits_LTE.shape
    probs_LTE = jax.nn.softmax(widened(logits_LTE), axis=-1)
    _, experts_LTK = jax.lax.top_k(probs_LTE, top_k)
    mask_LT = jnp.ones((L, T), jnp.float32) if mask_T is None else jnp.broadcast_to(mask_T.astype(jnp.float32), (L, T))
    picks_E = jnp.sum(jax.nn.one_hot(experts_LTK, E, dtype=jnp.float32) * mask_LT[..., None, None], axis=(0, 1, 2))
    rows = jnp.sum(mask_LT)
    tokens_per_expert_E = picks_E / rows  # transformers divides the picks by the rows, not by rows * k
    probability_per_expert_E = jnp.sum(probs_LTE * mask_LT[..., None], axis=(0, 1)) / rows
    return E * jnp.sum(tokens_per_expert_E * probability_per_expert_E)


def router_penalty(cfg, sums_L: RouterSums) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the auxiliary loss the training loss adds, metrics) of a model config `cfg` (jaxllm.config.schema.
    ModelConfig) from its layers' router sums [L, B, ...]: `moe_aux_loss_coef` times the load-balancing loss plus
    `moe_z_loss_coef` times the z-loss; the metrics are the two losses and `moe/<stat>/layer_<i>` per layer
    (`router_metrics`)."""
    aux, z = router_losses(sums_L, cfg.experts_per_token)
    per_layer = router_metrics(sums_L, cfg.experts_per_token)
    metrics = {f"moe/{name}/layer_{i}": v[i] for name, v in per_layer.items() for i in range(v.shape[0])}
    if cfg.moe_bias_update_rate:  # the train step takes it out of the metrics to move the routers' biases
        metrics[EXPERT_LOAD] = jnp.sum(sums_L.picks, axis=1)
    return cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z, {"moe_aux_loss": aux, "moe_z_loss": z, **metrics}


def gradient_only(value: jax.Array, penalty: jax.Array) -> jax.Array:
    """`value` whose gradient also carries `penalty`'s: the auxiliary losses train the router without entering
    the reported or held-out loss."""
    return value + (penalty - jax.lax.stop_gradient(penalty))


class MoEMLP(nnx.Module):
    """The mixture-of-experts feed-forward of one layer (or a stack of them, `stack`): a router [D, E] and E gated
    experts [E, D, F] / [E, F, D] with the family's activation; with `shared_mlp_dim` Fs > 0 also a shared expert
    (Qwen2-MoE), a gated MLP [D, Fs] / [Fs, D] laid out as the dense MLP's and its gate [D, 1]. Its call returns the
    output and the router's `RouterSums` per row, from which the auxiliary losses and the metrics are taken."""

    def __init__(self, dim: int, mlp_dim: int, num_experts: int, top_k: int, *, renormalize: bool, activation: str,
                 init_std: float, out_std: float, dtype, rngs: nnx.Rngs, stack: tuple = (),
                 dispatch: str = "dropless", capacity_factor: float = 1.0, shared_mlp_dim: int = 0,
                 scores: str = "softmax", bias_update_rate: float = 0.0, exchange: str = "auto",
                 quant: str = "none"):
        D, F, E, Fs = dim, mlp_dim, num_experts, shared_mlp_dim
        lead = ("layers",) * len(stack)
        self.router = param(rngs, stack + (D, E), lead + ("embed", "expert"), dtype, init_std)
        self.gate_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.up_proj = param(rngs, stack + (E, D, F), lead + ("expert", "embed", "mlp"), dtype, init_std)
        self.down_proj = param(rngs, stack + (E, F, D), lead + ("expert", "mlp", "embed"), dtype, out_std)
        shared = lambda shape, names, std: param(rngs, stack + shape, lead + names, dtype, std) if Fs else None
        self.shared_gate_proj = shared((D, Fs), ("embed", "mlp"), init_std)
        self.shared_up_proj = shared((D, Fs), ("embed", "mlp"), init_std)
        self.shared_down_proj = shared((Fs, D), ("mlp", "embed"), out_std)
        self.shared_expert_gate = shared((D, 1), ("embed", None), init_std)
        self.router_bias = RouterBias(jnp.zeros(stack + (E,), jnp.float32), out_sharding=lead + (None,),
                                      update_rate=bias_update_rate) if bias_update_rate else None
        self.top_k, self.renormalize, self.activation, self.scores = top_k, renormalize, activation, scores  # static
        self.dispatch, self.capacity_factor, self.exchange = dispatch, capacity_factor, exchange  # static
        self.quant = quant  # precision.quant of the experts' and the shared expert's projections (static)

    def __call__(self, x_BTD: jax.Array, dropless: bool = False) -> tuple[jax.Array, RouterSums]:
        """(output [B, T, D], the router's sums per row); `dropless` overrides a capacity dispatch (decoding). On
        a mesh each device routes its own rows to the experts of its expert group (jaxllm/parallel/experts.py)."""
        capacity_factor = self.capacity_factor if self.dispatch == "capacity" and not dropless else None
        layer = functools.partial(moe_on_device, top_k=self.top_k, renormalize=self.renormalize, scores=self.scores,
                                  activation=self.activation, capacity_factor=capacity_factor, quant=self.quant)
        router = (self.router[...], None if self.router_bias is None else self.router_bias[...])
        out_BTD, sums = run_experts(layer, x_BTD, router, self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                                    split_seq=capacity_factor is None,
                                    exchange=self.exchange if capacity_factor is None else "gather")
        if self.shared_gate_proj is not None:
            out_BTD = out_BTD + self._shared_expert(x_BTD)
        return checkpoint_name(out_BTD, "mlp_out"), sums

    def _shared_expert(self, x_BTD: jax.Array) -> jax.Array:
        """The shared expert's output [B, T, D]: outside `run_experts`' shard_map, on the whole activations, so it
        splits as a dense MLP does (hidden units over `tensor`, the batch over the batch axes)."""
        gate = lambda spec, x: project(spec, x, self.shared_gate_proj, None, quant=self.quant)
        up = lambda spec, x: project(spec, x, self.shared_up_proj, None, quant=self.quant)
        down = lambda spec, x: project(spec, x, self.shared_down_proj, None, quant=self.quant)
        out_BTD = gated_mlp(x_BTD, self.activation, gate, up, down)
        # The gate's logit in the compute dtype (a matmul, as transformers' Linear), its sigmoid in float32.
        logit_BT1 = project("BTD,DO->BTO", x_BTD, self.shared_expert_gate, None)
        return out_BTD * jax.nn.sigmoid(widened(logit_BT1)).astype(out_BTD.dtype)


def moe_on_device(x_BTD, router, gate_EDF, up_EDF, down_EFD, group: ExpertGroup, *, top_k: int,
                  renormalize: bool, activation: str, capacity_factor: float | None, scores: str = "softmax",
                  quant: str = "none"):
    """One device's part of a mixture-of-experts layer (`run_experts`' `layer`): route its rows (`router`: the
    router's kernel [D, E] and its `RouterBias` [E] or None), run its experts (`gate_EDF`... hold E_local of the
    router's E) over its expert group's picks of them, dropless or with `capacity_factor`, and return (its rows'
    outputs [B, T, D], its rows' `RouterSums`); the experts' matmuls quantised as `quant` says."""
    B, T, D = x_BTD.shape
    router_DE, bias_E = router
    E, K = router_DE.shape[-1], top_k
    routing = route(x_BTD.reshape(B * T, D), router_DE, K, renormalize, scores, bias_E)
    kept_BKT = None
    if capacity_factor is not None:  # computed per row: the same here as on the gathered rows below
        kept_BKT = expert_slots(routing.experts.reshape(B, T, K), E, capacity(T, K, E, capacity_factor))[1]
    sums = group.row_total(router_sums(routing, B, E, kept_BKT))
    if group.ragged:
        return _exchanged_experts(x_BTD, routing, gate_EDF, up_EDF, down_EFD, group, activation, quant), sums
    x_ND = group.gather(x_BTD).reshape(-1, D)
    rows = x_ND.shape[0] // T
    picks = Routing(None, group.gather(routing.experts.reshape(B, T * K)).reshape(-1, K),
                    group.gather(routing.weights.reshape(B, T * K)).reshape(-1, K))
    window = dict(first_expert=group.first_expert(gate_EDF.shape[0]), num_experts=E)
    quantised = dict(quant=quant, row_axes=group.row_axes)
    if capacity_factor is None:
        out_ND = dropless_experts(x_ND, picks, gate_EDF, up_EDF, down_EFD, activation, **window, **quantised)
    else:
        out_ND = capacity_experts(x_ND, picks, gate_EDF, up_EDF, down_EFD, activation, capacity_factor, rows,
                                  **window, **quantised)[0]
    return group.combine(out_ND.reshape(rows, T, D)), sums


def _exchanged_experts(x_BTD, routing: Routing, gate_EDF, up_EDF, down_EFD, group: ExpertGroup, activation: str,
                       quant: str = "none"):
    """Dropless dispatch through the ragged exchange (jaxllm/parallel/experts.py): this device's picks sent to
    their experts' devices, its experts run over what it received, the outputs brought back, weighted and added
    per token (in float32, then the compute dtype) [B, T, D]."""
    B, T, D = x_BTD.shape
    sent = group.send_to_experts(x_BTD.reshape(B * T, D), routing.experts, routing.logits.shape[-1])
    out_PD = grouped_experts(sent.rows, gate_EDF, up_EDF, down_EFD, activation, sent.group_sizes, quant,
                             group.row_axes)
    out_PD = group.send_back(out_PD, sent)
    weighted_TKD = widened(out_PD.reshape(B * T, -1, D)) * routing.weights[..., None]
    return group.tensor_total(jnp.sum(weighted_TKD, axis=1).astype(x_BTD.dtype).reshape(B, T, D))
