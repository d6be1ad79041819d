"""Gradients of an objective's loss through an explicit pipeline schedule (`pipeline.schedule` = 1f1b,
interleaved_1f1b or zb_h1 on a mesh with stage > 1): the loss function is cut at the model's layer stack and run
by jaxllm/parallel/scheduled.py.

Any objective's `loss_fn(model, batch, rng)` is cut without being rewritten, with the model's layer-stack hook
(`jaxllm.model.transformer.layer_stack_runner`): traced with a runner that stops at the stack, it gives the
stack's input (the embedding) and per-token inputs; with a runner that runs one chunk of stacked layers, a chunk;
with a runner that returns a given output, the rest (final norm, head, loss). The loss is then that of each
pipeline micro-batch, summed, as with gradient accumulation (`optim.grad_accum`), which the train step already
defines: loss sums and gradients add up exactly; metrics are averaged over the micro-batches.

The first pass through the layer stack is the trained one. Later passes in the same loss (DPO's reference: the
same base with the adapters off) get no gradient: they run forward first, over the whole batch with the GPipe
scan, and the loss's tail reads their outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.transformer import layer_stack_runner
from jaxllm.parallel.pipeline import num_stages, split_microbatches
from jaxllm.parallel.schedules import EXPLICIT, build
from jaxllm.parallel.scheduled import StageFunctions, scheduled_value_and_grad

LAYERS = "layers"  # the layer stack's name in the model's state


def runs_explicit_schedule(model) -> bool:
    """Whether `model`'s gradients come from the explicit forward-backward (its schedule, on a stage mesh)."""
    return getattr(model, "pipeline_schedule", None) in EXPLICIT and num_stages() > 1


class _AtLayerStack(Exception):
    """Stops a loss function's trace at its first layer stack, carrying what reached it."""


def _layer_stack_call(loss_fn, model, mb, key):
    """(layers module, input x_BTD, LayerStackCall) of the first layer stack `loss_fn` runs on `model`."""
    def stop(layers, x_BTD, call):
        raise _AtLayerStack(layers, x_BTD, call)

    try:
        with layer_stack_runner(stop):
            loss_fn(model, mb, key)
    except _AtLayerStack as reached:
        return reached.args
    raise ValueError("the loss function never runs the model's layers: nothing to pipeline")


def _split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the layer stack's variables, the others) of a model state."""
    return nnx.split_state(state, lambda path, _: path[0] == LAYERS, ...)


def _later_passes(graphdef, params, frozen, batch, key, loss_fn) -> list[jax.Array]:
    """The outputs [B, T, D] of the loss's later passes through a layer stack (after the trained first), forward
    over the whole batch, without gradient; [] when there is one pass."""
    passes: list[jax.Array | None] = []  # None for the trained first pass: the schedule runs it

    def record(layers, x_BTD, call):
        if not passes:
            passes.append(None)
            return jnp.zeros_like(x_BTD), None
        out = call.run_as_usual(x_BTD)
        passes.append(jax.lax.stop_gradient(out[0]))
        return out

    with layer_stack_runner(record):
        loss_fn(nnx.merge(graphdef, params, frozen), batch, key)
    return passes[1:]


def _stage_functions(graphdef, loss_fn, key, chunk_layers: int) -> StageFunctions:
    """The model of `graphdef` with `loss_fn`, cut at its layer stack (see the module docstring)."""
    def model(outer, layers):
        (outer_t, outer_f), (layers_t, layers_f) = outer, layers
        return nnx.merge(graphdef, nnx.merge_state(outer_t, nnx.State({LAYERS: layers_t})),
                         nnx.merge_state(outer_f, nnx.State({LAYERS: layers_f})))

    def embed(outer, layers, mb):
        return _layer_stack_call(loss_fn, model(outer, layers), mb["batch"], key)[1]

    def chunk(outer, layers, x_BTD, mb, c):
        stack, _, call = _layer_stack_call(loss_fn, model(outer, layers), mb["batch"], key)
        own = lambda per_layer: None if per_layer is None else jax.lax.dynamic_slice_in_dim(
            per_layer, c * chunk_layers, chunk_layers, 0)
        return call.run_chunk(stack, x_BTD, own(call.keys_L), own(call.local_L))[0]

    def tail(outer, layers, x_BTD, mb):
        outputs = iter([x_BTD, *mb["later"]])

        def given(layers, x, call):
            return next(outputs), None

        with layer_stack_runner(given):
            loss_sum, count, metrics = loss_fn(model(outer, layers), mb["batch"], key)
        return loss_sum, (count, metrics)

    return StageFunctions(embed, chunk, tail)


def scheduled_grads(graphdef, params, frozen, batch, key, loss_fn, scale=None):
    """((loss sum, target count, metrics), gradients of `params`) of `loss_fn` over `batch`, like
    `jax.value_and_grad` of it with the loss times `scale` (None: 1; the gradients come back scaled), through the
    model's explicit pipeline schedule."""
    model = nnx.merge(graphdef, params, frozen)
    p, m, r = num_stages(), model.pipeline_microbatches, model.pipeline_repeats
    schedule = build(model.pipeline_schedule, p, m, r)
    later = _later_passes(graphdef, params, frozen, batch, key, loss_fn)
    mbs = jax.tree.map(lambda a: split_microbatches(a, m), {"batch": batch, "later": later})
    (layers_t, outer_t), (layers_f, outer_f) = _split(params), _split(frozen)
    num_layers = model.cfg.num_layers
    fns = _stage_functions(graphdef, loss_fn, key, num_layers // (p * r))
    seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    (loss_sum, (count, metrics)), (layer_grads, outer_grads) = scheduled_value_and_grad(
        fns, (layers_t.get(LAYERS, nnx.State({})), layers_f.get(LAYERS, nnx.State({}))), (outer_t, outer_f), mbs,
        schedule, seed)
    grads = nnx.merge_state(outer_grads, nnx.State({LAYERS: layer_grads}))
    return (loss_sum, count, jax.tree.map(lambda v: v / m, metrics)), grads
