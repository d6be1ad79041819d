"""The diagnostic variant of the train step, and its use by the training loop.

`make_diagnostic_step` is `jaxllm.train.step.make_train_step` with an `observe` hook: the same step, computed
by the same code, plus per-layer / per-group norms, Adam's second-moment statistics and finiteness flags. Every
`diagnostics.every` steps the loop runs it (without donation) on the state and batch of the production step it
is about to dispatch, then the production step makes the update as always: the update is the production step's
bitwise and that program is untouched (tests/test_diagnostics_stats.py: its compiled HLO is the same with
diagnostics on and off, and a measured step's new state equals an unmeasured one's bitwise).

Activation statistics (residual-stream RMS and max, SwiGLU gate saturation, attention-logit max, output
logits) join through the optional `activations` callable, `activations(graphdef, params, frozen, batch) ->
dict` ([L] arrays and scalars), e.g. `jaxllm.observe.activations.activation_stats`.

On XLA:CPU the variant runs its layers unrolled (`jaxllm.model.transformer.layers_unrolled`). XLA:CPU's thunk
runtime orders a program's collectives one after another, but not a while loop holding collectives (a layer
scan, whose FSDP all-gathers run inside it) against the collectives beside it that no data path orders: each
device takes them in the order its threads reach them. The collectives block their thread (gloo across
processes, a rendezvous within one), so two devices that took them in different orders wait for each other for
ever. Seen in the variant's replay of a NaN step: a 2-process GRPO job hung in 1 of 15 runs under load (gdb:
one device in a token count's all-reduce, the other in the layer loop's all-gather), and the single-process
tests aborted now and then at XLA's 180 s rendezvous limit. XLA's thunk graphs (read from its logs) of that
job had four such pairs, all in the variant (token counts' all-reduces beside its forward and backward layer
loops), none in its other programs. Unrolled, no collective of the variant sits in a loop
(tests/test_diagnostics_stats.py). The same parameters and statistics (up to rounding: XLA fuses across the
unrolled layers); only compile time grows with depth, which on a CPU run of a small model costs little. Other
backends order collectives on their streams and keep the scan.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.model.transformer import layers_unrolled
from jaxllm.observe.nonfinite import finite_flags, first_nonfinite
from jaxllm.observe.norms import adam_v_stats, layer_and_group_norms
from jaxllm.parallel.offload import on_host, stream_opt_state
from jaxllm.train.faults import with_scaled_loss
from jaxllm.train.step import NO_FROZEN, StepTrace, batch_sharding, make_train_step

PREFIX = "diag/"
NOT_REPRODUCED = "none (the step was finite when replayed)"

Activations = Callable[..., dict]


def flat_stats(stats: dict) -> dict:
    """`diag/<name>` scalars of `stats`: an [L] array becomes `diag/<name>/layer_<i>`."""
    out = {}
    for name, value in stats.items():
        if getattr(value, "ndim", 0):
            out.update({f"{PREFIX}{name}/layer_{i}": value[i] for i in range(value.shape[0])})
        else:
            out[f"{PREFIX}{name}"] = value
    return out


def _in_order(*trees):
    """`trees` through one optimization barrier: whatever is computed from the results starts after all of them.

    The variant's passes run one after another in the compiled schedule: the activations' forward, then the step,
    then the statistics of what the step saw and did (the statistics of the old parameters once ran beside the
    step's layer loop on some devices and after it on others, and a reward-model run with `optim.zero1` on a
    2x2x2 mesh aborted at XLA's 180 s rendezvous limit every time). XLA:CPU expands the barrier before its
    runtime, which then runs what no data path orders in any order; there the unrolled layers (module docstring)
    are what keeps the devices' collectives in one order."""
    return jax.lax.optimization_barrier(trees)


def diagnostic_observer() -> Callable[[StepTrace], dict]:
    """The `observe` hook of the variant: {"stats": flat `diag/...` scalars, "finite": flags for
    `first_nonfinite`}, computed after the whole step."""

    def observe(trace: StepTrace) -> dict:
        (trace,) = _in_order(trace)
        stats = {**layer_and_group_norms(trace.state.params, trace.grads, trace.updates),
                 **adam_v_stats(trace.new_state.opt_state)}
        return {"finite": {"params": finite_flags(trace.state.params), "grads": finite_flags(trace.grads)},
                "stats": stats}

    return observe


def make_diagnostic_step(objective, tx, activations: Activations | None = None, unrolled: bool = False,
                         **step_args) -> Callable:
    """`step(state, batch, frozen) -> (new state, metrics, diag)`: the production step of the same arguments
    (`step_args`: those of `make_train_step`), whose new state and metrics it returns unchanged, and `diag`
    from `diagnostic_observer`, with the activation statistics (a forward pass of the pre-step parameters on the
    step's batch, before the step) under "activations" and in its stats when `activations` is given.
    `unrolled`: trace the models' layers unrolled (what `DiagnosticSteps` asks for on XLA:CPU; module docstring)."""
    step = make_train_step(objective, tx, observe=diagnostic_observer(), **step_args)

    def diagnostic_step(state, batch, frozen=NO_FROZEN):
        measured = activations(objective.graphdef, state.params, frozen, batch)
        measured, state, batch, frozen = _in_order(measured, state, batch, frozen)
        new_state, metrics, diag = step(state, batch, frozen)
        return new_state, metrics, dict(diag, stats={**diag["stats"], **flat_stats(measured)}, activations=measured)

    traced = step if activations is None else diagnostic_step
    if not unrolled:
        return traced

    def unrolled_step(state, batch, frozen=NO_FROZEN):
        with layers_unrolled():
            return traced(state, batch, frozen)

    return unrolled_step


class DiagnosticSteps:
    """The loop's side of the variant (owned by `jaxllm.train.step_runner.StepRunner`).

    `due(step)`: whether `step` is measured. `measure(state, batch, frozen)` runs the variant on the state and
    batch the production step is about to take, without donating or returning a state, and gives its `diag/`
    statistics (device scalars; the loop adds them to that step's metrics and MetricsLog writes them as a record
    of their own). The production step then makes the update as on every other step, so the update is the
    production step's bitwise by construction. (One program doing both was tried first: on the tiny job's
    (2, 2, 2) mesh XLA fused it differently and the embedding came out a few ulps off after one step.) The cost
    is one more forward and backward pass every `every` steps.

    `explain(record, state, frozen, writer, skipped)` analyses a step whose metrics came back non-finite: it
    replays that step's batch (kept for the last two steps; a drill's step with its loss factor, as it ran)
    through the variant, writes a `diag/` record with `diag/first_nonfinite`, and adds that field to `record`
    (Recovery copies it into the incident). The state it replays from is the run's current one: under
    train.on_anomaly skip and rollback the non-finite step left parameters and optimizer state unchanged
    (decided inside the step), so that is the step's own starting state, advanced by at most the one step
    already dispatched after it. Under abort the non-finite update was applied and the parameters are poisoned,
    so nothing is replayed.

    Each variant is jitted when first needed (once per drill loss factor) and compiles once per batch shape.
    """

    def __init__(self, objective, tx, step_args: dict, every: int, shardings, frozen_shardings, mesh, log,
                 activations: Activations | None = None):
        self.objective, self.tx, self.step_args, self.every = objective, tx, step_args, every
        self.shardings, self.frozen_shardings, self.mesh, self.log = shardings, frozen_shardings, mesh, log
        self.activations = activations
        self.variants: dict = {}  # drill loss factor (None: none) -> the jitted variant
        self.ran: dict[int, tuple] = {}  # step -> (batch, loss factor of a drill or None), the last two steps

    def _step_fn(self, factor=None):
        objective = self.objective if factor is None else with_scaled_loss(self.objective, factor)
        return make_diagnostic_step(objective, self.tx, activations=self.activations,
                                    unrolled=jax.default_backend() == "cpu", **self.step_args)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def remember(self, step: int, batch, factor=None) -> None:
        """Keep what step `step` ran on, for `explain` (the batch arrays are shared, not copied)."""
        self.ran[step] = (batch, factor)
        self.ran.pop(step - 2, None)

    def _variant(self, factor):
        """`(state, batch, frozen) -> (metrics, diag)`, nothing donated."""
        if factor not in self.variants:
            step_fn = self._step_fn(factor)
            if on_host(self.shardings.opt_state):
                step_fn = stream_opt_state(step_fn, self.shardings)
            ins = (self.shardings, batch_sharding(self.mesh), self.frozen_shardings)
            self.variants[factor] = jax.jit(lambda s, b, f: step_fn(s, b, f)[1:], in_shardings=ins,
                                            out_shardings=NamedSharding(self.mesh, PartitionSpec()))
        return self.variants[factor]

    def measure(self, state, batch, frozen) -> dict:
        """The `diag/` statistics of the step the production step is about to make from `state` on `batch`."""
        first = None not in self.variants
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            _, diag = self._variant(None)(state, batch, frozen)
        if first:
            self.log(f"compiled and ran the diagnostic step in {time.perf_counter() - start:.1f}s")
        return diag["stats"]

    def explain(self, record: dict, state, frozen, writer, skipped: bool) -> dict:
        """`record` (one step's fetched metrics), with `diag/first_nonfinite` when the step was non-finite
        (`skipped`: the step left the state unchanged; see the class docstring)."""
        step = record["step"]
        if not record.get("nonfinite") or step not in self.ran:
            return record
        if not skipped:
            name = "unknown (train.on_anomaly=abort applied the non-finite update; nothing replayed)"
            diag = {}
        else:
            batch, factor = self.ran[step]
            with jax.set_mesh(self.mesh):
                metrics, out = jax.device_get(self._variant(factor)(state, batch, frozen))
            name = first_nonfinite(out["finite"], float(metrics["loss"]), out.get("activations")) or NOT_REPRODUCED
            diag = {k: float(v) for k, v in out["stats"].items()}
        writer.write({"step": step, **diag, f"{PREFIX}first_nonfinite": name})
        self.log(f"step {step}: first non-finite: {name}")
        return dict(record, **{f"{PREFIX}first_nonfinite": name})


def split_diag(values: dict) -> tuple[dict, dict]:
    """(the step's own metrics, its `diag/` statistics) of one step's fetched metrics."""
    diag = {k: v for k, v in values.items() if k.startswith(PREFIX)}
    return {k: v for k, v in values.items() if not k.startswith(PREFIX)}, diag

