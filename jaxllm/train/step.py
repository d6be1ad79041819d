"""The pure train and eval steps every objective shares. Each is jitted once, with the train state donated.

`step(state, batch, frozen)`: the objective's `loss_fn` over `grad_accum` micro-batches, gradients of the
trainable variables only (`state.params`), anomaly checks, one optimizer update scaled by `state.lr_scale`.
Frozen variables are an input that is never donated, differentiated or updated. A batch is a dict of arrays
whose leading axis is the global batch (rows split over the batch mesh axes).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config.schema import AnomalyConfig
from jaxllm.model.moe import EXPERT_LOAD, balance_router_bias
from jaxllm.observe.norms import step_norms
from jaxllm.optim.loss_scale import NO_LOSS_SCALING, LossScaling, excuse_overflow, non_finite
from jaxllm.parallel.offload import on_host, stream_opt_state
from jaxllm.optim.chain import current_clip_norm, current_lr
from jaxllm.optim.powersgd import PowerSGD, compressed_grads_and_loss
from jaxllm.optim.veto import VetoableTransformation, keep_if
from jaxllm.parallel.sharding import active_mesh, constrain, logical_to_spec, spec_leaves, split_over_replicas
from jaxllm.train.anomaly import detect, push
from jaxllm.train.scheduled_grads import runs_explicit_schedule, scheduled_grads
from jaxllm.train.state import TrainState

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# A loss_fn metric > 0 under this name vetoes the step's update (PPO's approximate-KL early stop): parameters
# and optimizer state stay as they were, decided inside the compiled step like a skipped anomaly.
SKIP_UPDATE = "skip_update"
NO_FROZEN = nnx.State({})  # the frozen input of objectives whose every variable trains


def batch_sharding(mesh) -> NamedSharding:
    """Rows of a batch split over the batch axes (data, fsdp, expert); replicated over tensor and stage."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return NamedSharding(mesh, logical_to_spec(("batch", None), None, sizes, kind="activations"))


def _micro_batches(batch, num_micro: int):
    """[B, ...] -> [A, B/A, ...] taking every A-th row, so each device's rows stay on that device."""

    def split(x):
        x = x.reshape((x.shape[0] // num_micro, num_micro) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def _constrain_rows(batch):
    """Every field's leading axis split over the batch mesh axes (a second axis is the sequence)."""
    return {k: constrain(v, (("batch", "seq") + (None,) * v.ndim)[:v.ndim]) for k, v in batch.items()}


def _like_params(tree, params, layout=None):
    """`tree` (shaped like `params`, e.g. gradients) constrained to `layout` (PartitionSpecs in leaf order), by
    default the parameters' layout under the active mesh (the RULES of their logical names), so that under fsdp
    it stays split like the parameters rather than being whatever XLA's propagation picks; as is outside any
    mesh."""
    mesh = active_mesh()
    if mesh is None:
        return tree
    specs = spec_leaves(params, mesh) if layout is None else layout
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([jax.lax.with_sharding_constraint(x, spec)
                              for x, spec in zip(leaves, specs, strict=True)])


def update_layout(params, zero1: bool):
    """The PartitionSpecs (in leaf order) the optimizer update of `params` is computed in under the active
    mesh: with `zero1` (`optim.zero1`) each parameter's is split over the batch axes it is replicated over
    (`jaxllm.parallel.sharding.replicas_split`), so the gradients are reduce-scattered rather than all-reduced,
    each device updates its own share of the moments, and the new parameters are all-gathered; None (the
    parameters' own layout) without it or outside any mesh."""
    mesh = active_mesh()
    if not zero1 or mesh is None or mesh.manual_axes:
        return None
    return jax.tree.leaves(split_over_replicas(params, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))


def grads_and_loss(graphdef, params, batch, grad_accum: int = 1, *, loss_fn, frozen=NO_FROZEN,
                   rng=None, scale=None, layout=None):
    """(gradients, mean loss, target-token count, metrics) of one batch, for the trainable `params` only.

    Gradients of the summed token loss are accumulated over `grad_accum` micro-batches and divided once by
    the batch's total target-token count, so accumulation equals one big batch exactly (no per-micro mean).
    Micro-batch i draws from `fold_in(rng, i)`; `metrics` (from `loss_fn`) are averaged over micro-batches.
    The accumulated gradients (the scan's carry) and each micro-batch's gradients are pinned to the parameters'
    layout: under fsdp the carry is split like the parameters, never a replicated float32 copy.
    With a loss `scale` (jaxllm/optim/loss_scale.py) the backward pass runs on the loss times `scale`, and the
    accumulated gradients are divided by it again: they come back unscaled (non-finite where it overflowed).
    `layout` (PartitionSpecs in leaf order, `update_layout`) replaces the parameters' layout for the gradients.
    """
    def loss_of(p, mb, key):
        return loss_fn(nnx.merge(graphdef, p, frozen), mb, key)

    def micro_step(mb, index):
        """(gradients in the parameters' layout, summed loss, count, metrics) of micro-batch `index`."""
        key = None if rng is None else jax.random.fold_in(rng, index)

        def loss_and_aux(p):
            loss_sum, count, metrics = loss_of(p, _constrain_rows(mb), key)
            return loss_sum if scale is None else loss_sum * scale, (loss_sum, count, metrics)

        if runs_explicit_schedule(nnx.merge(graphdef, params, frozen)):  # 1F1B and the like: written-out backward
            (loss_sum, count, metrics), grads = scheduled_grads(graphdef, params, frozen, _constrain_rows(mb), key,
                                                                loss_fn, scale)
            return _like_params(grads, params, layout), loss_sum, count, metrics
        (_, (loss_sum, count, metrics)), grads = jax.value_and_grad(loss_and_aux, has_aux=True)(params)
        return _like_params(grads, params, layout), loss_sum, count, metrics

    if grad_accum == 1:  # no accumulation loop: its carry would cost a zeroed gradient buffer and an add over it,
        # whole passes over parameter-sized buffers that every data-parallel device repeats
        grads, loss_sum, count, metrics = micro_step(batch, 0)
    else:
        def accumulate(carry, xs):
            grads, loss_sum, count, metrics = jax.tree.map(jnp.add, carry, micro_step(*xs))
            return (_like_params(grads, params, layout), loss_sum, count, metrics), None

        micro = _micro_batches(batch, grad_accum)
        first = jax.tree.map(lambda x: x[0], micro)
        # The loss sum, token count and metrics start at zeros of their own types (float64 in a float64 run).
        sums = jax.eval_shape(lambda: loss_of(params, first, rng)[:3])
        zeros = _like_params(jax.tree.map(jnp.zeros_like, params), params, layout)  # the carry, split as the grads
        init = (zeros, *jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), sums))
        (grads, loss_sum, count, metrics), _ = jax.lax.scan(accumulate, init, (micro, jnp.arange(grad_accum)))
    denom = jnp.maximum(count, 1.0)
    unscale = denom if scale is None else denom * scale  # one division, exact for a power-of-two scale
    metrics = jax.tree.map(lambda m: m / grad_accum, metrics)
    return jax.tree.map(lambda g: g / unscale, grads), loss_sum / denom, count, metrics


def vetoed_update(tx: optax.GradientTransformation, grads, opt_state, params, keep):
    """(updates, new optimizer state) of `tx`; where the scalar `keep` is true the state is the old one (and the
    updates are to be dropped). A `VetoableTransformation` (jaxllm's AdamW and LAMB) vetoes inside its moment
    updates at no extra cost; any other transformation is vetoed by a select over its whole state, a pass more
    over every moment (jaxllm/optim/veto.py)."""
    if keep is None:
        return tx.update(grads, opt_state, params)
    if isinstance(tx, VetoableTransformation):
        return tx.update(grads, opt_state, params, veto=keep)
    updates, new_state = tx.update(grads, opt_state, params)
    return updates, keep_if(keep, opt_state, new_state)


class StepTrace(NamedTuple):
    """What one train step saw and did, for an `observe` callable of `make_train_step`: the state it started
    from, its batch and frozen variables, the gradients (before clipping), the update it computed (scaled by
    `lr_scale`; an update the step vetoed was still computed, from the kept moments with jaxllm's AdamW and
    LAMB) and the state it returns."""

    state: TrainState
    batch: dict
    frozen: object
    grads: object
    updates: object
    new_state: TrainState


def make_train_step(objective, tx: optax.GradientTransformation, grad_accum: int = 1,
                    anomaly: AnomalyConfig = AnomalyConfig(), skip_anomalies: bool = False,
                    loss_scaling: LossScaling = NO_LOSS_SCALING,
                    observe: Callable[[StepTrace], dict] | None = None,
                    compression: PowerSGD | None = None, zero1: bool = False) -> Callable:
    """`step(state, batch, frozen=NO_FROZEN) -> (state, metrics)` for `objective` (see the module docstring).
    Metrics are device scalars (the loop reads them one step late), among them the global norms of
    `jaxllm.observe.norms.step_norms` (against the clipping threshold in the optimizer state, 0: none).

    With `observe`, the step returns `(state, metrics, observe(trace))` instead: the same computation with more
    outputs (the diagnostic variant, jaxllm/train/diagnostic_step.py). Without it nothing of it is traced.

    Every step checks for anomalies (`jaxllm.train.anomaly.detect` against the state's history windows); with
    `skip_anomalies` an anomalous step leaves parameters and optimizer state unchanged, decided inside the
    compiled step (no host round trip), so the step dispatched after it starts from a healthy state.

    With `loss_scaling` enabled (float16 compute) the loss is scaled by `state.loss_scale`, and a step whose
    gradients overflow is skipped the same way (optimizer step count included) without being an anomaly or
    entering the history windows; metrics gain `loss_scale` (the scale this step used) and `overflow` (0 or 1).

    With `compression` (PowerSGD, jaxllm/optim/powersgd.py; the state carries its `powersgd` state) the gradients are
    computed per `data` shard, unscaled, and reduced over `data` as low-rank factors; the optimizer sees the
    decompressed mean. A skipped step (overflow, anomaly) leaves the compression's state unchanged too.

    With `zero1` (`optim.zero1`; the optimizer state placed by `state_shardings(..., zero1=True)`) the update
    is computed in `update_layout`: each data-parallel replica updates its own share of the parameters and
    moments, and the new parameters are all-gathered.
    """
    graphdef, loss_fn = objective.graphdef, objective.loss_fn

    def step(state: TrainState, batch, frozen=NO_FROZEN):
        scale = loss_scaling.scale_of(state.loss_scale) if loss_scaling.enabled else None
        layout = update_layout(state.params, zero1)
        if compression is None:
            grads, loss, count, extra = grads_and_loss(graphdef, state.params, batch, grad_accum, loss_fn=loss_fn,
                                                       frozen=frozen, rng=state.step_key(), scale=scale,
                                                       layout=layout)
            overflow = non_finite(grads) if loss_scaling.enabled else jnp.zeros((), bool)
            compressor = state.powersgd  # None
        else:  # the shards' unscaled gradients are checked for overflow before compression mixes them
            grads, loss, count, extra, compressor, overflow = compressed_grads_and_loss(
                functools.partial(grads_and_loss, graphdef, grad_accum=grad_accum, loss_fn=loss_fn), state.params,
                batch, frozen, state.step_key(), state.powersgd, state.step, compression, scale)
            overflow = overflow if loss_scaling.enabled else jnp.zeros((), bool)
            grads = grads if layout is None else _like_params(grads, state.params, layout)
        load = extra.pop(EXPERT_LOAD, None)  # a mixture of experts' picks per expert, for its routing bias
        grad_norm = optax.tree.norm(grads)
        flags = detect(loss, excuse_overflow(grad_norm, overflow), state.loss_window, state.grad_window, anomaly)
        is_anomaly = flags["anomaly"]

        veto = [is_anomaly] if skip_anomalies else []
        veto += [overflow] if loss_scaling.enabled else []
        veto += [extra[SKIP_UPDATE] > 0] if SKIP_UPDATE in extra else []
        keep = functools.reduce(jnp.logical_or, veto) if veto else None  # a vetoed step keeps the old state
        updates, opt_state = vetoed_update(tx, grads, state.opt_state, state.params, keep)
        updates = jax.tree.map(lambda u: u * state.lr_scale, updates)
        updates = updates if layout is None else _like_params(updates, state.params, layout)
        norms = step_norms(state.params, updates, grad_norm, current_clip_norm(state.opt_state), layout)
        # A never-true test (norms are not negative) that makes the writes of the new parameters wait for the
        # norms, so they go over the old ones in place after every read of them. Without it XLA copies the
        # parameters on entry: about a tenth of the step of a data-parallel 42M model on 8 CPU devices
        # (scripts/bench_step.py; tests/test_in_place_update.py).
        drop = (norms["param_norm"] < 0) | (norms["update_norm"] < 0)
        drop = drop if keep is None else drop | keep
        new_params = optax.apply_updates(state.params, updates)
        new_params = new_params if load is None else balance_router_bias(new_params, load)
        new_params = new_params if layout is None else _like_params(new_params, state.params, layout)
        params = keep_if(drop, state.params, new_params)
        if keep is not None:
            compressor = keep_if(keep, state.powersgd, compressor)
        metrics = {
            **extra,
            "loss": loss,
            "grad_norm": grad_norm,
            **norms,
            "lr": current_lr(opt_state) * state.lr_scale,  # the rate this update used
            "target_tokens": count,
            **flags,
            **({"loss_scale": scale, "overflow": overflow.astype(jnp.float32)} if loss_scaling.enabled else {}),
        }
        healthy = ~is_anomaly & ~overflow
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state,
            loss_window=push(state.loss_window, loss, healthy),
            grad_window=push(state.grad_window, grad_norm, healthy),
            loss_scale=loss_scaling.update(state.loss_scale, overflow), powersgd=compressor,
        )
        if observe is None:
            return new_state, metrics
        return new_state, metrics, observe(StepTrace(state, batch, frozen, grads, updates, new_state))

    return step


def make_eval_step(graphdef, loss_fn) -> Callable:
    """`eval_step(params, batch, frozen=NO_FROZEN) -> (loss_sum, token_count)` for token-weighted held-out loss
    (`loss_fn` with no randomness: dropout off)."""

    def eval_step(params, batch, frozen=NO_FROZEN):
        return loss_fn(nnx.merge(graphdef, params, frozen), _constrain_rows(batch), None)[:2]

    return eval_step


def jit_train_step(step_fn, state_shardings, mesh, frozen_shardings=None, compiler_options=None):
    """Compile-once wrapper: state donated (frozen variables never), shardings pinned so every step reuses one
    executable. Without `frozen_shardings` the step takes (state, batch) only. An optimizer state whose
    shardings are in host memory (`jaxllm.train.state.state_shardings`) streams to the device for the update.
    `compiler_options`: XLA options of this compile only (jax.jit's), over those of XLA_FLAGS."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if on_host(state_shardings.opt_state):
        step_fn = stream_opt_state(step_fn, state_shardings)
    ins = (state_shardings, batch_sharding(mesh)) + (() if frozen_shardings is None else (frozen_shardings,))
    return jax.jit(step_fn, in_shardings=ins, out_shardings=(state_shardings, replicated), donate_argnums=(0,),
                   compiler_options=compiler_options)


def jit_eval_step(eval_fn, param_shardings, mesh, frozen_shardings=None):
    replicated = NamedSharding(mesh, PartitionSpec())
    ins = (param_shardings, batch_sharding(mesh)) + (() if frozen_shardings is None else (frozen_shardings,))
    return jax.jit(eval_fn, in_shardings=ins, out_shardings=replicated)
