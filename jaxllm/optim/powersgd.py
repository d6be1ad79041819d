"""PowerSGD gradient compression across the `data` mesh axis (Vogels, Karimireddy & Jaggi, NeurIPS 2019).

Plain data parallelism lets XLA all-reduce every gradient over `data`. With `optim.grad_compression=powersgd`
the train step instead computes each data shard's own gradient inside a `jax.shard_map` that is manual over
`data` only (fsdp / tensor stay automatic: the model's layout and the reduction over fsdp are as without it), and
sends low-rank factors of each gradient matrix across `data` instead of the matrix. Per matrix M [m, n] of a
data shard (its gradient plus its error feedback e), with Q [n, r] kept from the previous step (warm start):

    M = g + e;  P = mean_data(M Q);  P = orthonormal(P);  Q = mean_data(M^T P);  M_hat = P Q^T;  e = M - M_hat

so r (m + n) numbers cross `data` instead of m n, and M_hat is the gradient the optimizer (and global-norm
clipping) sees. M_hat depends on the shards' matrices through their mean only, so when r is at least the rank of
the mean gradient M_hat is that mean and training equals uncompressed data parallelism.

What is a matrix: a parameter's leading `layers` / `stage` dimensions are a batch of matrices (each layer's own
factors, the matmuls batched); the rest split into [m, n] where m + n is smallest (a q_proj [D, N, H] is
[D, N*H], an o_proj [N, H, D] is [N*H, D]). r = min(`optim.powersgd_rank`, m, n). A matrix is compressed when
its factors are at most 1/MIN_COMPRESSION of it (torch's `min_compression_rate`); vectors (norm scales) and
matrices too small to gain are all-reduced whole.

State (`PowerSGDState`, the train state's `powersgd` field, checkpointed with it), float32, for the compressed
matrices only, keyed by parameter path: `q` [*layers, n, r], the same on every data shard (replicated over
`data`; its n dimension split like the parameter's, when the parameter's split allows); `error` [data,
*parameter shape], one residual per data shard: row i lives on data shard i, sharded inside like the
parameter (its gradient's layout), so a device holds one float32 gradient-sized buffer. A checkpoint therefore
resumes on the same `mesh.data` only.

The first `optim.powersgd_start_step` steps all-reduce whole gradients (the paper's uncompressed warm-up) and
leave Q and the error buffers as they are; compression starts at the step after. Under AdamW the compressed
steps of early training cost progress a later phase does not make up (the held-out loss gap to uncompressed
training opens within ~50 steps of the start and then stays), so the default starts at step 100 (see
scripts/bench_powersgd.py for the measurements). Token normalisation stays
exact: each shard scales its gradient by its share of the batch's target tokens (psum over `data`), so the
mean over `data` is the gradient of the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct, traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config.schema import OptimConfig
from jaxllm.optim.loss_scale import non_finite
from jaxllm.parallel.sharding import spec_leaves

DATA = "data"
BATCH_DIMS = ("layers", "stage")  # leading logical dimensions that stack matrices (one factor pair each)
MIN_COMPRESSION = 2.0  # compress only when the factors are at most half the matrix (torch's min_compression_rate)
HIGHEST = jax.lax.Precision.HIGHEST  # the factors' matmuls in true float32 (no TF32 / bf16 passes on GPUs)


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """The compression a train step applies (`optim.powersgd_rank`, `optim.powersgd_start_step`)."""

    rank: int = 4
    start_step: int = 100


def from_config(cfg: OptimConfig) -> PowerSGD | None:
    """The configured compression; None for `optim.grad_compression=none`."""
    if cfg.grad_compression != "powersgd":
        return None
    return PowerSGD(cfg.powersgd_rank, cfg.powersgd_start_step)


@struct.dataclass
class PowerSGDState:
    """Per compressed matrix (nested dicts keyed by parameter path): `q` the warm-start factor, `error` the
    per-data-shard residual (see the module docstring)."""

    q: Any
    error: Any


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """A parameter seen as a batch of matrices: `lead` leading batch dimensions, then [m, n] (the dimensions
    before / from `split`), factored at rank `rank`."""

    lead: int
    split: int
    m: int
    n: int
    rank: int

    def factors_shape(self, shape) -> tuple[int, ...]:
        return tuple(shape[:self.lead]) + (self.n, self.rank)


def matrix_view(shape, names, rank: int) -> MatrixView | None:
    """How a parameter of `shape` with logical `names` is compressed at `rank`; None: all-reduced whole."""
    names = tuple(names or (None,) * len(shape))
    lead = 0
    while lead < len(shape) and names[lead] in BATCH_DIMS:
        lead += 1
    rest = shape[lead:]
    if len(rest) < 2:
        return None
    split = min(range(1, len(rest)), key=lambda k: math.prod(rest[:k]) + math.prod(rest[k:]))
    m, n = math.prod(rest[:split]), math.prod(rest[split:])
    r = min(rank, m, n)
    if m * n < MIN_COMPRESSION * r * (m + n):
        return None
    return MatrixView(lead, lead + split, m, n, r)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _leaves(params) -> list[tuple[tuple[str, ...], tuple[int, ...], tuple | None]]:
    """(path, shape, logical names) of every parameter, in the order of `jax.tree.leaves(params)`."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
    return [(_path(path), tuple((var.get_value() if _is_variable(var) else var).shape),
             var.get_metadata().get("out_sharding") if _is_variable(var) else None) for path, var in flat]


def _views(params, rank: int) -> list[tuple[tuple[str, ...], MatrixView | None]]:
    """(path, view) of every parameter, in the order of `jax.tree.leaves(params)`."""
    return [(path, matrix_view(shape, names, rank)) for path, shape, names in _leaves(params)]


def init_state(params, compression: PowerSGD, data_size: int, seed: int = 0) -> PowerSGDState:
    """Fresh state for `params` (traceable; jit it with `state_shardings` to create it in place): Q standard
    normal (the same on every data shard), error buffers zero."""
    q, error = {}, {}
    for index, ((path, view), leaf) in enumerate(zip(_views(params, compression.rank), jax.tree.leaves(params))):
        if view is None:
            continue
        key = jax.random.fold_in(jax.random.key(seed), index)
        q[path] = jax.random.normal(key, view.factors_shape(leaf.shape), jnp.float32)
        error[path] = jnp.zeros((data_size,) + tuple(leaf.shape), jnp.float32)
    return PowerSGDState(q=traverse_util.unflatten_dict(q), error=traverse_util.unflatten_dict(error))


def with_state(state, compression: PowerSGD | None, mesh, shardings=None):
    """A train state (or its ShapeDtypeStructs) with a PowerSGD state when `compression` asks for one and it has
    none yet (a fresh start; a resumed state has its own): abstract for an abstract `state`, else created in
    place per `shardings.powersgd` (the train state's, `jaxllm.train.state.state_shardings`)."""
    if compression is None or state.powersgd is not None:
        return state
    data_size = dict(zip(mesh.axis_names, mesh.axis_sizes))[DATA]
    init = functools.partial(init_state, state.params, compression, data_size)  # reads shapes and names only
    if shardings is None:
        return state.replace(powersgd=jax.eval_shape(init))
    return state.replace(powersgd=jax.jit(init, out_shardings=shardings.powersgd)())


def state_shardings(abstract: PowerSGDState, params, mesh) -> PowerSGDState:
    """Shardings of a PowerSGD state on `mesh`: error buffers P('data', *the parameter's spec); Q split on its
    leading and n dimensions like the parameter's (the n side's first dimension, when the rest of it is whole)."""
    leaves = {path: (shape, names) for path, shape, names in _leaves(params)}
    specs = dict(zip(leaves, spec_leaves(params, mesh)))

    def q_spec(path, q):
        shape, names = leaves[path]
        view = matrix_view(shape, names, q.shape[-1])
        spec = tuple(specs[path]) + (None,) * (len(shape) - len(specs[path]))
        n_side = spec[view.split:]
        n_spec = n_side[0] if all(s is None for s in n_side[1:]) else None
        return PartitionSpec(*spec[:view.lead], n_spec, None)

    q = {p: NamedSharding(mesh, q_spec(p, x)) for p, x in traverse_util.flatten_dict(abstract.q).items()}
    error = {p: NamedSharding(mesh, PartitionSpec(DATA, *specs[p])) for p in traverse_util.flatten_dict(abstract.error)}
    return PowerSGDState(q=traverse_util.unflatten_dict(q), error=traverse_util.unflatten_dict(error))


def _orthonormal(p):
    """Orthonormal columns spanning P's (reduced QR; Householder stays orthonormal when P is rank deficient,
    where Gram-Schmidt would divide by zero), one matrix at a time: on XLA:CPU a batched QR splits its batch over
    the intra-op thread pool from inside each fake device's thread, and with 8 devices at rank 8 every device
    waited on that pool forever (at the first compressed step of the default job over data=8)."""
    flat = p.reshape((-1,) + p.shape[-2:])
    return jnp.stack([jnp.linalg.qr(matrix)[0] for matrix in flat]).reshape(p.shape)


def _compress(g, q, e, view: MatrixView):
    """(M_hat in g's dtype, new Q, new error) of one matrix on this data shard (see the module docstring)."""
    shape = g.shape
    m = (g.astype(jnp.float32) + e).reshape(shape[:view.lead] + (view.m, view.n))
    p = jax.lax.pmean(jnp.einsum("...mn,...nr->...mr", m, q, precision=HIGHEST), DATA)
    p = _orthonormal(p)
    q = jax.lax.pmean(jnp.einsum("...mn,...mr->...nr", m, p, precision=HIGHEST), DATA)
    approx = jnp.einsum("...mr,...nr->...mn", p, q, precision=HIGHEST)
    return approx.reshape(shape).astype(g.dtype), q, (m - approx).reshape(shape)


def _reduce(grads, state: PowerSGDState, step, compression: PowerSGD):
    """(mean gradients over `data`, new state): compressed from `compression.start_step` on."""
    leaves, treedef = jax.tree.flatten(grads)
    qs, errors = traverse_util.flatten_dict(state.q), traverse_util.flatten_dict(state.error)
    views = _views(grads, compression.rank)

    def whole():
        return [jax.lax.pmean(g, DATA) for g in leaves], state

    def compressed():
        out, new_q, new_error = [], {}, {}
        for (path, view), g in zip(views, leaves):
            if view is None or path not in qs:
                out.append(jax.lax.pmean(g, DATA))
                continue
            g, new_q[path], error = _compress(g, qs[path], errors[path][0], view)
            new_error[path] = error[None]
            out.append(g)
        return out, PowerSGDState(q=traverse_util.unflatten_dict(new_q),
                                  error=traverse_util.unflatten_dict(new_error))

    if compression.start_step == 0:
        out, state = compressed()
    else:  # both branches compile; each step runs one, so only its collectives run
        out, state = jax.lax.cond(step < compression.start_step, whole, compressed)
    return treedef.unflatten(out), state


def compressed_grads_and_loss(compute: Callable, params, batch, frozen, rng, state: PowerSGDState, step,
                              compression: PowerSGD, scale=None):
    """`compute(params, batch, frozen=, rng=, scale=) -> (grads, loss, count, metrics)` (the step's
    `grads_and_loss`, which unscales its gradients by a loss `scale`) run per data shard, its gradients reduced
    over `data` through PowerSGD. Returns (grads, loss, count, metrics, new state, overflow), the first four as
    `compute` returns them for the whole batch (metrics: the mean of the shards'); `overflow`: whether any
    shard's unscaled gradients are non-finite (checked before compression mixes the shards). Trace under the
    mesh (`jax.set_mesh`); `step` is the number of updates done so far."""

    def per_shard(params, batch, frozen, rng, state, step, scale):
        if rng is not None:  # each shard draws its own randomness (dropout) for its own rows
            rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA))
        grads, loss, count, metrics = compute(params, batch, frozen=frozen, rng=rng, scale=scale)
        overflow = jax.lax.pmax(non_finite(grads).astype(jnp.int32), DATA) > 0
        total = jax.lax.psum(count, DATA)
        share = count * jax.lax.axis_size(DATA) / jnp.maximum(total, 1.0)  # mean over data = the whole batch's
        grads = jax.tree.map(lambda g: g * share.astype(g.dtype), grads)
        loss = jax.lax.psum(loss * count, DATA) / jnp.maximum(total, 1.0)
        metrics = jax.tree.map(lambda m: jax.lax.pmean(m, DATA), metrics)
        grads, state = _reduce(grads, state, step, compression)
        return grads, loss, total, metrics, state, overflow

    replicated, split = PartitionSpec(), PartitionSpec(DATA)
    state_specs = PowerSGDState(q=jax.tree.map(lambda _: replicated, state.q),
                                error=jax.tree.map(lambda _: split, state.error))
    # check_vma=False: grads_and_loss's accumulation scan starts from data-invariant zeros; the collectives here
    # are the only cross-shard traffic, and every output marked replicated is a psum / pmean.
    return jax.shard_map(
        per_shard, in_specs=(replicated, split, replicated, replicated, state_specs, replicated, replicated),
        out_specs=(replicated, replicated, replicated, replicated, state_specs, replicated), axis_names={DATA},
        check_vma=False,
    )(params, batch, frozen, rng, state, step, scale)
