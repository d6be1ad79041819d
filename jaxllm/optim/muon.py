"""Muon (`optim.name=muon`): orthogonalised momentum on the hidden matrices, Adam on everything else.

Each hidden kernel (attention q/k/v/o, MLP gate/up/down, a mixture of experts' expert and shared-expert kernels)
is one matrix per layer (and per expert): its `layers` / `stage` / `expert` axes are batch axes, `embed` is
one side of the matrix and its other axes the other, in the kernel's own order (q_proj [L, D, N, H] is a
D x (N*H) matrix per layer, o_proj [L, N, H, D] an (N*H) x D one). Its update is Keller Jordan's Muon step:

    m <- beta * m + g;   u <- g + beta * m   (Nesterov)
    O <- Newton-Schulz_5(u / (|u|_F + eps))  (quintic (3.4445, -4.7750, 2.0315), on the transpose when
                                               rows > cols, so X X^T is the smaller square)
    update = 0.2 * sqrt(max(rows, cols)) * O

0.2 * sqrt(max(rows, cols)) is Moonlight's rule ("Muon is Scalable for LLM Training", Liu et al. 2025): O has
singular values near 1, so its RMS is about 1 / sqrt(max(rows, cols)), and the factor gives it AdamW's typical
update RMS of 0.2, so `optim.lr` and `optim.weight_decay` mean what they mean for AdamW. The embeddings, the
head, norms, biases and routers take `jaxllm.optim.veto.scale_by_adam`; decoupled weight decay and the learning
rate come after both (`jaxllm.optim.chain.make_optimizer`).

Why not `optax.contrib.muon` (0.2.8) as it stands: its batch axes (`MuonDimensionNumbers`) and vmapped
orthogonalisation do handle stacked and sharded kernels, and `consistent_rms=0.2` is Moonlight's scaling, but
(1) its Nesterov momentum is a bias-corrected moving average, `beta * m / (1 - beta^(t+1)) + (1 - beta) * g /
(1 - beta^t)`, whose mix of the newest gradient and the momentum differs from the reference's `g + beta * m`
in the first tens of steps; (2) its Adam side shares `nesterov` (so it is NAdam), `eps` and one unmasked weight
decay (norms and embeddings decay with the head, or nothing does); (3) the orthogonaliser and the shape scaling
it is built from are private (`optax.contrib._muon`), and `scale_by_muon` keeps a momentum of its own, so it
cannot serve as a bare orthogonaliser for the reference momentum. What is written here: the momentum, the
Newton-Schulz iterations (ten lines) and the split by logical axis names; the partition, Adam, decay and learning
rate are optax's.

Sharding (`orthogonalize`): each device iterates on whole matrices. A mesh axis that splits a matrix dimension
(fsdp on `embed`, tensor on `heads` / `kv_heads` / `mlp`) is moved onto a batch dimension it divides by an
all-to-all inside a `jax.shard_map` (each device then holds whole matrices of its part of the stack), and moved
back after; an axis no batch dimension takes is all-gathered, and each device keeps its own slice of the
result. Over `data` the iterations are repeated by each replica, as the rest of the update is (with ZeRO-1 the
momentum is gathered over `data` first). On the default job (4 layers, data=2, fsdp=2, tensor=2) that is 28
all-to-alls and nothing else: docs/training.md (Muon) has the figures from the compiled step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxllm.optim.veto import scale_by_adam
from jaxllm.parallel.sharding import active_mesh, logical_to_spec, mesh_sizes

# Keller Jordan's quintic: maximal slope at zero, singular values driven into about [0.7, 1.2] in 5 steps
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # the reference's: u / (|u|_F + eps)
MATCH_ADAMW_RMS = 0.2  # Moonlight: the update RMS AdamW typically has
MUON_KERNELS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "shared_gate_proj", "shared_up_proj", "shared_down_proj"})
BATCH_AXES = frozenset({"layers", "stage", "expert"})  # one matrix per layer, per pipeline stage, per expert
MUON, ADAM = "muon", "adam"


class MatrixAxes(NamedTuple):
    """How a kernel is a stack of matrices: its batch axes, then the row axes and the column axes (in order)."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]


def matrix_axes(names) -> MatrixAxes | None:
    """The matrix axes of a hidden kernel with logical axis `names` (batch axes leading, `embed` the first or
    last of the others); None if it is not one."""
    batch = tuple(i for i, n in enumerate(names) if n in BATCH_AXES)
    rest = tuple(i for i, n in enumerate(names) if n not in BATCH_AXES)
    if batch != tuple(range(len(batch))) or len(rest) < 2 or "embed" not in names:
        return None
    split = rest.index(names.index("embed"))
    if split == 0:  # embed -> ... (q/k/v, gate, up): embed x rest
        return MatrixAxes(batch, rest[:1], rest[1:])
    if split == len(rest) - 1:  # ... -> embed (o, down): rest x embed
        return MatrixAxes(batch, rest[:-1], rest[-1:])
    return None


def muon_labels(params):
    """`params` with each variable's value replaced by MUON (a hidden kernel, `matrix_axes`) or ADAM."""

    def one(path, var):
        key = getattr(path[-1], "key", None)
        names = var.get_metadata().get("out_sharding") or ()
        is_kernel = type(var) is nnx.Param and key in MUON_KERNELS and matrix_axes(names) is not None
        return var.replace(MUON if is_kernel else ADAM)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Regroup(NamedTuple):
    """How the devices of a mesh axis that splits a kernel's matrix dimension `dim` get whole matrices: the
    axis moves to batch dimension `to` (an all-to-all: each device then holds whole matrices of its own part
    of the stack), or, with `to` None, the matrix dimension is all-gathered over it (every device of the axis
    iterates on the same matrices)."""

    axis: str
    dim: int
    to: int | None


def regroup(names, shape, sizes: dict[str, int]) -> tuple[PartitionSpec, list[Regroup]]:
    """(the layout at rest of a hidden kernel with logical `names`, the regroupings that give each device whole
    matrices): each mesh axis splitting a matrix dimension (minor axes first, as they come off) moves to the
    first batch dimension whose local size it divides, else is gathered."""
    rest = logical_to_spec(names, shape, sizes)
    entries = [list(_axes(rest[d] if d < len(rest) else None)) for d in range(len(shape))]
    axes, moves = matrix_axes(names), []
    for d in axes.rows + axes.cols:
        for axis in reversed(entries[d]):
            to = next((b for b in axes.batch if shape[b] % math.prod(sizes[a] for a in entries[b] + [axis]) == 0),
                      None)
            if to is not None:
                entries[to].append(axis)  # axes moved on later are minor to it, as the all-to-alls leave them
            moves.append(Regroup(axis, d, to))
    return rest, moves


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def orthogonalize(u: jax.Array, names, steps: int) -> jax.Array:
    """`newton_schulz` of a hidden kernel with logical `names` where it lies: under a mesh inside one
    `jax.shard_map`, its matrices brought whole to the devices by `regroup` and taken back after.

    Why by hand: left to the partitioner (jax 0.10), the iterations on a kernel split over fsdp and tensor
    run split and re-split (all-gathers, all-reduces and permutes of every product over data, fsdp and tensor,
    115 MB per device per step on the default job, 9x the kernels' bytes), and a sharding constraint to the
    regrouped layout lowers to a full gather ('involuntary full rematerialization')."""
    axes = matrix_axes(names)
    mesh = active_mesh()
    if mesh is None or mesh.manual_axes:
        return newton_schulz(u, axes, steps)
    sizes = mesh_sizes(mesh)
    rest, moves = regroup(names, u.shape, sizes)

    def local(x):
        for m in moves:
            if m.to is None:
                x = jax.lax.all_gather(x, m.axis, axis=m.dim, tiled=True)
            else:
                x = jax.lax.all_to_all(x, m.axis, m.to, m.dim, tiled=True)
        x = newton_schulz(x, axes, steps)
        for m in reversed(moves):
            if m.to is None:
                part = x.shape[m.dim] // sizes[m.axis]
                x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(m.axis) * part, part, m.dim)
            else:
                x = jax.lax.all_to_all(x, m.axis, m.dim, m.to, tiled=True)
        return x

    return jax.shard_map(local, in_specs=rest, out_specs=rest, check_vma=False)(u)


def newton_schulz(u: jax.Array, axes: MatrixAxes, steps: int) -> jax.Array:
    """The orthogonalised `u` (each matrix of the stack, see `MatrixAxes`), in float32, shaped as `u`."""
    shape = u.shape
    rows, cols = math.prod(shape[i] for i in axes.rows), math.prod(shape[i] for i in axes.cols)
    x = u.astype(jnp.float32).reshape(shape[:len(axes.batch)] + (rows, cols))
    if rows > cols:  # NS(X^T) = NS(X)^T: iterate on the wide side, so A = X X^T is min(rows, cols) square
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)) + NS_EPS)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = jnp.einsum("...ik,...jk->...ij", x, x)
        poly = b * gram + c * jnp.einsum("...ik,...kj->...ij", gram, gram)
        x = a * x + jnp.einsum("...ik,...kj->...ij", poly, x)
    if rows > cols:
        x = jnp.swapaxes(x, -1, -2)
    return x.reshape(shape)


class MuonState(NamedTuple):
    """The momentum `m` of each hidden kernel (the reference's sum `beta * m + g`, not a moving average)."""

    mu: optax.Updates


def scale_by_muon(beta: float = 0.95, ns_steps: int = 5) -> optax.GradientTransformation:
    """Keller Jordan's Muon step times Moonlight's 0.2 * sqrt(max(rows, cols)) (module docstring), for trees of
    hidden kernels (`nnx.Param`s whose logical names `matrix_axes` reads), before decay and learning rate."""

    def init_fn(params):
        return MuonState(mu=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: beta * m + g.astype(m.dtype), state.mu, updates)
        nesterov = jax.tree.map(lambda m, g: g + beta * m.astype(g.dtype), mu, updates)

        def one(var):
            u = var.get_value()
            if isinstance(u, optax.MaskedNode):  # a parameter of the Adam side (`optax.partition`)
                return var
            names = var.get_metadata()["out_sharding"]
            axes = matrix_axes(names)
            scale = MATCH_ADAMW_RMS * math.sqrt(max(math.prod(u.shape[i] for i in axes.rows),
                                                    math.prod(u.shape[i] for i in axes.cols)))
            return var.replace((scale * orthogonalize(u, names, ns_steps)).astype(u.dtype))

        out = jax.tree.map(one, nesterov, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return out, MuonState(mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_muon_and_adam(beta: float, ns_steps: int, b1: float, b2: float, eps: float):
    """`scale_by_muon` on the hidden kernels, `jaxllm.optim.veto.scale_by_adam` on every other parameter
    (`muon_labels`); decay and the learning rate are the caller's."""
    return optax.partition({MUON: scale_by_muon(beta, ns_steps), ADAM: scale_by_adam(b1, b2, eps)}, muon_labels)
