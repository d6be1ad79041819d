"""Fault injection for drills, outside the production step.

`debug.inject_nan_at_step=K` and `debug.inject_spike_at_step=K` make step K run a second compiled variant of the
train step whose loss is multiplied by NaN (a non-finite loss and gradients) or by 1000 (a loss spike, every
gradient x1000 too). Every other step runs the production step, which carries no trace of injection. Each fault
fires once per process: a rolled-back step that runs again is not injected again.

`debug.stall_at_step=K` makes the loop wait `debug.stall_s` seconds for step K's metrics, a hung step for the
hang watchdog (train.hang_timeout_s) to catch.
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import DebugConfig
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
