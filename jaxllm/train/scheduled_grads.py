"""Gradients of an objective's loss through an explicit pipeline schedule (`pipeline.schedule` = 1f1b,
interleaved_1f1b or zb_h1 on a mesh with stage > 1): the loss function is cut at the model's layer stack and run
by jaxllm/parallel/scheduled.py.

Any objective's `loss_fn(model, batch, rng)` is cut without being rewritten, with the model's layer-stack hook
(`jaxllm.model.transformer.layer_stack_runner`): traced with a runner that stops at the stack, it gives the
stack's input (the embedding) and per-token inputs; with a runner that runs one chunk of stacked layers, a chunk
and its layers' statistics (a mixture of experts' router sums, whose auxiliary losses the loss adds); with a
runner that returns a given output, the rest (final norm, head, loss). The loss is then that of each pipeline
micro-batch, summed, as with gradient accumulation (`optim.grad_accum`), which the train step already defines:
loss sums and gradients add up exactly; metrics are averaged over the micro-batches; a mixture's auxiliary
losses are each micro-batch's, as under accumulation (the whole batch's routing is known only after every
micro-batch's forward, and 1F1B starts backwards before that).

A loss may run several layer stacks ("passes"). A pass trains when its stack is one of the model's own with
trained variables (PPO's critic: its adapters over the policy's base); one that does not (DPO's reference: the
base with the adapters off, a model of its own) gets no gradient. The schedule runs one trained pass at a time,
the other passes' outputs given, computed forward first over the whole batch (the GPipe scan, without gradient);
the gradients of the runs add up (the chain rule over the passes), and the outer parameters' gradients from the
loss's tail (head, final norms) are taken in the first run only. One trained pass (every objective but PPO) costs
no extra forward; PPO's two cost one more forward of each.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.transformer import layer_stack_runner
from jaxllm.parallel.pipeline import num_stages, split_microbatches
from jaxllm.parallel.schedules import EXPLICIT, build
from jaxllm.parallel.scheduled import StageFunctions, scheduled_value_and_grad


def runs_explicit_schedule(model) -> bool:
    """Whether `model`'s gradients come from the explicit forward-backward (its schedule, on a stage mesh)."""
    return getattr(model, "pipeline_schedule", None) in EXPLICIT and num_stages() > 1


class _Passes(NamedTuple):
    """The layer stacks a loss runs, in order: which train, and the model-state paths of the trained stacks'
    variables (split over `stage`; the rest of the state is whole on every stage)."""

    trained: tuple[bool, ...]
    stack_paths: frozenset


def _variable_paths(module) -> dict[int, tuple]:
    """{id(variable): its path in `module`'s state} (a shared variable at its first path, as nnx.state puts it)."""
    paths: dict[int, tuple] = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            paths.setdefault(id(node), tuple(path))
    return paths


def _passes(model, params, loss_fn, mb, key) -> _Passes:
    """Which of the layer stacks `loss_fn` runs on `model` train (see the module docstring)."""
    owned = _variable_paths(model)
    trained_paths = {tuple(path) for path, _ in nnx.to_flat_state(params)}
    stacks: list[set] = []

    def record(layers, x_BTD, call):
        stacks.append({owned[id(v)] for _, v in nnx.iter_graph(layers)
                       if isinstance(v, nnx.Variable) and id(v) in owned})
        return jnp.zeros_like(x_BTD), None

    with layer_stack_runner(record):
        loss_fn(model, mb, key)
    if not stacks:
        raise ValueError("the loss function never runs the model's layers: nothing to pipeline")
    trained = tuple(bool(paths & trained_paths) for paths in stacks)
    if not any(trained):  # only outer parameters train (a head on a frozen body): the first pass carries them
        trained = (True,) + trained[1:]
    return _Passes(trained, frozenset().union(*(s for s, t in zip(stacks, trained) if t)))


def _given_outputs(model, loss_fn, batch, key, needed: list[bool]) -> list:
    """Every pass's (output [B, T, D], statistics) forward over the whole batch without gradient where `needed`,
    None elsewhere."""
    outputs: list = []

    def run(layers, x_BTD, call):
        if not needed[len(outputs)]:
            outputs.append(None)
            return jnp.zeros_like(x_BTD), None
        out = jax.lax.stop_gradient(call.run_as_usual(x_BTD))
        outputs.append(out)
        return out

    with layer_stack_runner(run):
        loss_fn(model, batch, key)
    return outputs


def _stage_functions(graphdef, loss_fn, key, chunk_layers: int, own: int) -> StageFunctions:
    """The model of `graphdef` with `loss_fn`, cut at its pass `own`'s layer stack (the other passes' outputs
    given, in each micro-batch's "given"; see the module docstring)."""
    def model(outer, layers):
        (outer_t, outer_f), (layers_t, layers_f) = outer, layers
        return nnx.merge(graphdef, nnx.merge_state(outer_t, layers_t), nnx.merge_state(outer_f, layers_f))

    class _Reached(Exception):
        """Stops a loss function's trace at the layer stack of pass `own`, carrying what reached it."""

    def traced(outer, layers, mb, at_own):
        """`loss_fn` traced with the other passes given and pass `own` run by `at_own(layers, x_BTD, call)`."""
        passes = iter(range(len(mb["given"])))

        def runner(layers, x_BTD, call):
            i = next(passes)
            return at_own(layers, x_BTD, call) if i == own else mb["given"][i]

        with layer_stack_runner(runner):
            return loss_fn(model(outer, layers), mb["batch"], key)

    def reached(outer, layers, mb):
        """(layers module, input x_BTD, LayerStackCall) of pass `own`."""
        def stop(layers, x_BTD, call):
            raise _Reached(layers, x_BTD, call)

        try:
            traced(outer, layers, mb, stop)
        except _Reached as at:
            return at.args
        raise AssertionError("the loss ran fewer layer stacks than when its passes were counted")

    def embed(outer, layers, mb):
        return reached(outer, layers, mb)[1]

    def chunk(outer, layers, x_BTD, mb, c):
        stack, _, call = reached(outer, layers, mb)
        mine = lambda per_layer: None if per_layer is None else jax.lax.dynamic_slice_in_dim(
            per_layer, c * chunk_layers, chunk_layers, 0)
        return call.run_chunk(stack, x_BTD, mine(call.keys_L), mine(call.local_L))

    def tail(outer, layers, x_BTD, stats, mb):
        loss_sum, count, metrics = traced(outer, layers, mb, lambda *_: (x_BTD, stats))
        return loss_sum, (count, metrics)

    return StageFunctions(embed, chunk, tail)


def scheduled_grads(graphdef, params, frozen, batch, key, loss_fn, scale=None):
    """((loss sum, target count, metrics), gradients of `params`) of `loss_fn` over `batch`, like
    `jax.value_and_grad` of it with the loss times `scale` (None: 1; the gradients come back scaled), through the
    model's explicit pipeline schedule."""
    model = nnx.merge(graphdef, params, frozen)
    p, m, r = num_stages(), model.pipeline_microbatches, model.pipeline_repeats
    schedule = build(model.pipeline_schedule, p, m, r)
    passes = _passes(model, params, loss_fn, batch, key)
    runs = [i for i, t in enumerate(passes.trained) if t]
    needed = [runs != [i] for i in range(len(passes.trained))]  # given to another pass's run
    given = _given_outputs(nnx.merge(graphdef, params, frozen), loss_fn, batch, key, needed)
    mbs = jax.tree.map(lambda a: split_microbatches(a, m), {"batch": batch, "given": given})
    in_stack = lambda path, _: tuple(path) in passes.stack_paths
    (layers_t, outer_t), (layers_f, outer_f) = (nnx.split_state(s, in_stack, ...) for s in (params, frozen))
    seed = jnp.ones((), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    chunk_layers = model.cfg.num_layers // (p * r)
    results = [scheduled_value_and_grad(_stage_functions(graphdef, loss_fn, key, chunk_layers, own),
                                        (layers_t, layers_f), (outer_t, outer_f), mbs, schedule, seed,
                                        tail_outer_grads=own == runs[0])
               for own in runs]
    (loss_sum, (count, metrics)), _ = results[0]
    grads = jax.tree.map(lambda *g: sum(g[1:], g[0]),
                         *(nnx.merge_state(outer_grads, layer_grads) for _, (layer_grads, outer_grads) in results))
    return (loss_sum, count, jax.tree.map(lambda v: v / m, metrics)), grads
