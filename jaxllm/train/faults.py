"""Fault injection for drills, outside the production step.

`debug.inject_nan_at_step=K` and `debug.inject_spike_at_step=K` make step K run a second compiled variant of the
train step whose loss is multiplied by NaN (a non-finite loss and gradients) or by 1000 (a loss spike, every
gradient x1000 too). Every other step runs the production step, which carries no trace of injection. Each fault
fires once per process: a rolled-back step that runs again is not injected again.

`debug.stall_at_step=K` makes the loop wait `debug.stall_s` seconds for step K's metrics, a hung step for the
hang watchdog (train.hang_timeout_s) to catch.

`debug.zero_layer`, `debug.data_sleep_s` and `debug.router_scale` seed pathologies for the diagnosis
(jaxllm/diagnose): a dead layer, a throttled loader and a hot router.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from flax import nnx

from jaxllm.config.schema import DebugConfig
from jaxllm.train.objective import Objective

NAN_FACTOR, SPIKE_FACTOR = float("nan"), 1000.0


def planned_faults(debug: DebugConfig) -> dict[int, float]:
    """{step: loss factor} of the configured injections."""
    plan = ((debug.inject_nan_at_step, NAN_FACTOR), (debug.inject_spike_at_step, SPIKE_FACTOR))
    return {step: factor for step, factor in plan if step > 0}


def planned_stalls(debug: DebugConfig) -> dict[int, float]:
    """{step: seconds} of the configured stall."""
    return {debug.stall_at_step: debug.stall_s} if debug.stall_at_step > 0 else {}


def with_scaled_loss(objective: Objective, factor: float) -> Objective:
    """`objective` with its summed loss (and so every gradient) multiplied by `factor`."""
    inner = objective.loss_fn

    def loss_fn(model, batch, rng):
        loss_sum, count, metrics = inner(model, batch, rng)
        return loss_sum * factor, count, metrics

    return dataclasses.replace(objective, loss_fn=loss_fn)


def with_zeroed_layer(objective: Objective, layer: int) -> Objective:
    """`objective` whose model starts with every weight of stacked layer `layer` zero. All of them, not only the
    output projections: with o_proj/down_proj alone zeroed, their gradients are non-zero and AdamW moves them
    off zero within a few steps; with the whole layer zero every gradient of it is a product with a zero, so
    the layer stays dead for the whole run (the residual stream passes it unchanged)."""
    build = objective.build_model

    def build_model(key):
        model = build(key)
        params = nnx.state(model.layers, nnx.Param)
        nnx.update(model.layers, jax.tree.map(lambda w: w.at[layer].set(0), params))
        return model

    return dataclasses.replace(objective, build_model=build_model)


def with_scaled_router(objective: Objective, scale: float) -> Objective:
    """`objective` whose model starts with its mixture-of-experts routers' weights times `scale`: a hot router,
    whose logits pick the same experts by wide margins however the tokens differ a little."""
    build = objective.build_model

    def build_model(key):
        model = build(key)
        router = model.layers.mlp.router
        router[...] = router[...] * scale
        return model

    return dataclasses.replace(objective, build_model=build_model)


class ThrottledBatches:
    """A batch source that sleeps `seconds` before each batch: a loader too slow for the devices."""

    def __init__(self, source, seconds: float):
        self.source, self.seconds = source, seconds

    def __next__(self) -> dict:
        time.sleep(self.seconds)
        return next(self.source)

    def __getattr__(self, name):  # get_state, close, step_metrics, ...: the wrapped source's
        return getattr(self.source, name)
