"""Norms of parameters, gradients and updates: global (every step), per layer and per parameter group (the
diagnostic variant), and the optimizer's second-moment statistics.

Per-layer norms split a stacked parameter along its `layers` axes (found by the logical axis names of its
`out_sharding` metadata, as `jaxllm.optim.chain.decay_mask` reads them); several `layers` axes (a [stage,
layers_per_stage] stack) are flattened in order, which is the global layer index. Every sum of squares is taken
in float32 whatever the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxllm.model.numerics import widened
from jaxllm.parallel.sharding import active_mesh, spec_leaves, sum_over_devices

# Parameter groups by a Hugging Face name anywhere in a parameter's path (the first match from the leaf up).
# LoRA adapters (`<target>_lora`) are their own group, checked first.
GROUP_OF_NAME = {
    "embed_tokens": "embed", "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "input_layernorm": "norms", "post_attention_layernorm": "norms", "norm": "norms",
    "lm_head": "head", "score": "head",  # the language model's head; the reward / value model's scalar head
}
GROUPS = ("embed", "q", "k", "v", "o", "gate", "up", "down", "norms", "head", "lora")
STATS = ("grad_norm", "param_norm", "update_norm", "update_ratio")
LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: its dotted path, its group, and the positions of its stacked `layers` axes."""

    path: str
    group: str
    layer_axes: tuple[int, ...]


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def group_of(names: list[str]) -> str:
    """The group of a parameter at path `names` ("other" when no known name is in it)."""
    if any(n.endswith("_lora") for n in names):
        return "lora"
    for name in reversed(names):
        if name in GROUP_OF_NAME:
            return GROUP_OF_NAME[name]
    return "other"


def leaves(params) -> list[Leaf]:
    """Every parameter of `params` (an nnx.State of Variables, as the train state holds them), in tree order."""
    out = []
    for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        axes = tuple(getattr(var, "get_metadata", dict)().get("out_sharding") or ())
        out.append(Leaf(".".join(names), group_of(names), tuple(i for i, a in enumerate(axes) if a == LAYERS)))
    return out


def arrays(tree) -> list[jax.Array]:
    """The arrays of `tree` (parameters, or gradients / updates shaped like them) in `leaves` order. A Variable
    holding no array (`optax.MaskedNode`: a moment of Muon's Adam side for a matrix Muon updates) has none."""
    return [x[...] if _is_variable(x) else x for x in jax.tree.leaves(tree, is_leaf=_is_variable)
            if not _is_variable(x) or jax.tree.leaves(x)]


def _sq(x) -> jax.Array:
    return jnp.square(widened(x))  # float64 in a float64 run: the gradient's norm sets its clipping


def per_layer(x, layer_axes: tuple[int, ...], reduce=jnp.sum) -> jax.Array:
    """`reduce` of `x` over every axis but its `layers` axes, flattened to [L] (global layer order)."""
    moved = jnp.moveaxis(x, layer_axes, tuple(range(len(layer_axes))))
    rows = moved.reshape((-1,) + moved.shape[len(layer_axes):])
    return reduce(rows.reshape(rows.shape[0], -1), axis=1)


def _sum_sq(x) -> jax.Array:
    return jnp.sum(_sq(x))


def global_norm(tree) -> jax.Array:
    """The L2 norm of every array of `tree`, in float32 (float64 for float64 arrays)."""
    return jnp.sqrt(sum(_sum_sq(x) for x in arrays(tree)))


def global_norm_over_devices(tree, params, layout=None) -> jax.Array:
    """`global_norm` of `tree` (shaped like `params`, laid out by the PartitionSpecs `layout` in leaf order, by
    default the parameters' own) with every device reducing its own part of each array under the active mesh
    (jaxllm.parallel.sharding.sum_over_devices), rather than each replica all of it."""
    mesh = active_mesh()
    if mesh is None or mesh.manual_axes:
        return global_norm(tree)
    specs = spec_leaves(params, mesh) if layout is None else layout
    return jnp.sqrt(sum_over_devices(_sum_sq, arrays(tree), specs, mesh))


def _ratio(num, den):
    return num / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)


def step_norms(params, updates, grad_norm, clip_norm: jax.Array, update_layout=None) -> dict[str, jax.Array]:
    """The production step's global norms: `grad_norm_clipped` (the gradient norm after global-norm clipping at
    `clip_norm`, 0: none), `param_norm` (before the update), `update_norm` (the update computed, scaled by
    lr_scale) and `update_ratio` = update_norm / param_norm.

    The clipped norm is min(norm, threshold): what `optax.clip_by_global_norm` leaves (it rescales by
    threshold / norm when the norm exceeds the threshold), without re-running the clipping on every gradient.
    Each device reduces its own part of the parameters and updates (`global_norm_over_devices`; the updates
    laid out by `update_layout`, PartitionSpecs in leaf order, by default the parameters' layout).
    """
    clipped = jnp.where(clip_norm > 0, jnp.minimum(grad_norm, clip_norm), grad_norm)
    param_norm = global_norm_over_devices(params, params)
    update_norm = global_norm_over_devices(updates, params, update_layout)
    return {"grad_norm_clipped": clipped, "param_norm": param_norm, "update_norm": update_norm,
            "update_ratio": _ratio(update_norm, param_norm)}


def _squares(infos: list[Leaf], xs: list[jax.Array], num_layers: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """([L] sums of squares of the stacked parameters, {group: sum of squares}) of one tree."""
    layer = jnp.zeros((num_layers,), jnp.float32)
    group: dict[str, jax.Array] = {}
    for info, x in zip(infos, xs, strict=True):
        sq = _sq(x)
        if info.layer_axes:
            layer = layer + per_layer(sq, info.layer_axes)
        group[info.group] = group.get(info.group, 0.0) + jnp.sum(sq)
    return layer, group


def num_layers(infos: list[Leaf], xs: list[jax.Array]) -> int:
    """The length of the (flattened) `layers` axes; 0 when nothing is stacked."""
    sizes = {math.prod(x.shape[a] for a in i.layer_axes) for i, x in zip(infos, xs, strict=True) if i.layer_axes}
    if len(sizes) > 1:
        raise ValueError(f"stacked parameters disagree on the number of layers: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def layer_and_group_norms(params, grads, updates) -> dict[str, jax.Array]:
    """`diag/<stat>/layer_<i>` and `diag/<stat>/<group>` for stat in grad_norm, param_norm, update_norm,
    update_ratio (update / parameter norm), for every layer and every group present (`GROUPS`)."""
    infos, ps = leaves(params), arrays(params)
    L = num_layers(infos, ps)
    squares = {"grad_norm": _squares(infos, arrays(grads), L), "param_norm": _squares(infos, ps, L),
               "update_norm": _squares(infos, arrays(updates), L)}
    out: dict[str, jax.Array] = {}
    for stat, (layer, group) in squares.items():
        norm_L = jnp.sqrt(layer)
        out.update({f"diag/{stat}/layer_{i}": norm_L[i] for i in range(L)})
        out.update({f"diag/{stat}/{g}": jnp.sqrt(s) for g, s in group.items()})
    for key in [k for k in out if k.startswith("diag/update_norm/")]:
        where = key.removeprefix("diag/update_norm/")
        out[f"diag/update_ratio/{where}"] = _ratio(out[key], out[f"diag/param_norm/{where}"])
    return out


def second_moments(opt_state):
    """The arrays of Adam's second-moment estimate (`nu`) in `opt_state` (AdamW and LAMB both keep an optax
    ScaleByAdamState); empty for Adafactor, whose factored row / column statistics are not per-parameter second
    moments (and whose placeholder entries for the unused factor are zeros), so they are not reported."""
    states = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    return [x for s in states if isinstance(s, optax.ScaleByAdamState) for x in arrays(s.nu)]


def adam_v_stats(opt_state) -> dict[str, jax.Array]:
    """`diag/adam_v_rms` (root mean square over every second-moment entry) and `diag/adam_v_min`; {} without
    Adam moments (see `second_moments`)."""
    nus = second_moments(opt_state)
    if not nus:
        return {}
    count = sum(x.size for x in nus)
    return {"diag/adam_v_rms": jnp.sqrt(sum(_sum_sq(x) for x in nus) / count),
            "diag/adam_v_min": jnp.min(jnp.stack([jnp.min(x.astype(jnp.float32)) for x in nus]))}
