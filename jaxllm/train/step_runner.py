"""The compiled train step of a run (`StepRunner`): compiled once per batch shape and kept, the diagnostic
variant beside it, and the drills' scaled-loss variants compiled when their step comes. The loop calls it once
per step; the memory planner compiles through it so that a plan and a run compile the same program."""

from __future__ import annotations

import functools
import time

import jax

from jaxllm.config.schema import Config
from jaxllm.observe.activations import activation_stats
from jaxllm.optim import powersgd
from jaxllm.optim.loss_scale import loss_scaling
from jaxllm.train.diagnostic_step import DiagnosticSteps
from jaxllm.train.faults import planned_faults, with_scaled_loss
from jaxllm.train.objective import Objective
from jaxllm.train.step import jit_train_step, make_train_step


class StepRunner:
    """The compiled train step, one per batch shape (RL rows are as long as their iteration's prompt bucket;
    every other objective has one shape), and for drills (debug.inject_*) a variant with a scaled loss that
    runs once at its step, compiled when first needed. `compiler_options`: XLA options of the train steps'
    compiles (jax.jit's), over those of XLA_FLAGS."""

    def __init__(self, objective: Objective, tx, cfg: Config, shardings, frozen_shardings, mesh, log=print,
                 compiler_options=None):
        self.skips = cfg.train.on_anomaly in ("skip", "rollback")
        # Under `rollback` too an anomalous update is skipped inside the step: the next step, already dispatched
        # when the anomaly is seen, then starts from a healthy state, which is the fallback with no checkpoint.
        step_args = dict(grad_accum=cfg.optim.grad_accum, anomaly=cfg.anomaly, skip_anomalies=self.skips,
                         loss_scaling=loss_scaling(cfg.precision), compression=powersgd.from_config(cfg.optim),
                         zero1=cfg.optim.zero1)
        self._jit = lambda obj: jit_train_step(make_train_step(obj, tx, **step_args), shardings, mesh, frozen_shardings,
                                               compiler_options)
        self.objective, self.mesh, self.log = objective, mesh, log
        self.compiled: dict = {}  # batch shapes -> compiled step
        self.faults = planned_faults(cfg.debug)
        # The diagnostic variant every diagnostics.every steps, and the analysis of non-finite steps; its probed
        # forward pass runs in the step's micro-batches, so it needs no more activation memory than the step.
        activations = functools.partial(activation_stats, micro_batches=cfg.optim.grad_accum)
        self.diagnostics = DiagnosticSteps(objective, tx, step_args, cfg.diagnostics.every, shardings,
                                           frozen_shardings, mesh, log, activations=activations)

    def compile(self, state, batch, frozen) -> float:
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            self.compiled[_shapes(batch)] = self._jit(self.objective).lower(state, batch, frozen).compile()
        return time.perf_counter() - start

    def explain(self, record: dict, state, frozen, writer) -> dict:
        """`record` of a fetched step, named what went non-finite first when it is non-finite (see
        `DiagnosticSteps.explain`); `state` and `frozen` are the run's current ones."""
        return self.diagnostics.explain(record, state, frozen, writer, self.skips)

    def compiled_for(self, batch):
        """The compiled step of batches shaped like `batch` (`compile` made it)."""
        return self.compiled[_shapes(batch)]

    def __call__(self, step: int, state, batch, frozen):
        factor = self.faults.pop(step, None)
        self.diagnostics.remember(step, batch, factor)
        if factor is None:
            # Measured before the step: the step donates the state.
            diag = self.diagnostics.measure(state, batch, frozen) if self.diagnostics.due(step) else {}
            compiled = self.compiled.get(_shapes(batch))
            if compiled is None:
                seconds = self.compile(state, batch, frozen)
                self.log(f"compiled the train step for batches of shape {batch['tokens'].shape} in {seconds:.1f}s")
                compiled = self.compiled_for(batch)
            state, metrics = compiled(state, batch, frozen)
            return state, {**metrics, **diag}
        with jax.set_mesh(self.mesh):
            return self._jit(with_scaled_loss(self.objective, factor))(state, batch, frozen)


def _shapes(batch: dict) -> tuple:
    return tuple((k, v.shape) for k, v in sorted(batch.items()))
