"""Loss scaling for float16 compute: torch.amp.GradScaler's policy, decided inside the compiled train step.

float16 keeps 5 exponent bits: gradients below ~6e-8 flush to zero and values above 65504 overflow (bfloat16 has
float32's range and needs none of this). Every gradient is linear in the loss, so multiplying the loss by a scale
S before differentiating lifts the whole backward pass by S, out of the underflow range, and dividing the float32
gradients by S afterwards restores them. A step whose gradients come out non-finite overflowed: it is skipped
(parameters, optimizer state and its step count untouched). The dynamic policy then halves S, and doubles it after
`growth_interval` consecutive finite steps, so S settles just under the overflow threshold.

`precision.loss_scale`: "auto" (dynamic for float16 compute, none otherwise), "dynamic", "static:<v>" (a fixed
scale v; overflowing steps are still skipped) or "none". The scale lives in the train state (`LossScale`) and so
in every checkpoint, for every policy: with "none" it stays 1.0 and is never read, so checkpoints of all runs have
one layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.config.schema import LOSS_SCALE_MODES, check_loss_scale

# torch.amp.GradScaler's defaults: the issue fixes these; only the growth interval is a config value.
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR = 2.0**16, 2.0, 0.5
NONE, STATIC, DYNAMIC = LOSS_SCALE_MODES


@struct.dataclass
class LossScale:
    """The train state's part of loss scaling: the scale and the consecutive finite steps since it last
    changed (GradScaler's `_scale` and `_growth_tracker`)."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar


def new_loss_scale(scale: float = 1.0) -> LossScale:
    """A fresh `LossScale` at `scale` (traceable: built inside the jitted state initialiser)."""
    return LossScale(scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """The policy (static: part of the compiled step): `mode` none, static or dynamic, the scale a fresh run
    starts from (a static policy's only one) and the dynamic policy's growth interval."""

    mode: str = NONE
    init_scale: float = 1.0
    growth_interval: int = 2000

    @property
    def enabled(self) -> bool:
        return self.mode != NONE

    def scale_of(self, state: LossScale) -> jax.Array:
        """The scale this step multiplies its loss by: the state's under the dynamic policy; the configured
        value under the static one (so a resume with a changed value takes it)."""
        return state.scale if self.mode == DYNAMIC else jnp.asarray(self.init_scale, jnp.float32)

    def update(self, state: LossScale, overflow: jax.Array) -> LossScale:
        """The state after a step that did (`overflow`) or did not overflow.

        As torch's `_amp_update_scale_`: on overflow the scale backs off and the count restarts; otherwise the
        count grows and, reaching the growth interval, the scale grows (unless that would be infinite in
        float32) and the count restarts."""
        if self.mode != DYNAMIC:
            return LossScale(scale=self.scale_of(state), good_steps=state.good_steps)
        good = state.good_steps + 1
        grown = state.scale * GROWTH_FACTOR
        grow = good >= self.growth_interval
        scale = jnp.where(overflow, state.scale * BACKOFF_FACTOR,
                          jnp.where(grow & jnp.isfinite(grown), grown, state.scale))
        good = jnp.where(overflow | grow, 0, good)
        return LossScale(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32))


NO_LOSS_SCALING = LossScaling()


def non_finite(tree) -> jax.Array:
    """Whether any element of `tree` (gradients) is inf or NaN: a scaled step's overflow."""
    return ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def loss_scaling(precision) -> LossScaling:
    """The policy of a `jaxllm.config.schema.PrecisionConfig` (`loss_scale`, `loss_scale_growth_interval`, `compute`)."""
    spec = check_loss_scale(precision)
    if spec == NONE:
        return NO_LOSS_SCALING
    if spec == DYNAMIC:
        return LossScaling(DYNAMIC, INIT_SCALE, precision.loss_scale_growth_interval)
    return LossScaling(STATIC, float(spec.partition(":")[2]), precision.loss_scale_growth_interval)


def excuse_overflow(grad_norm: jax.Array, overflow: jax.Array) -> jax.Array:
    """The gradient norm the anomaly checks see: 0 on an overflowing step, whose non-finite gradients are the
    scale's business (the step is skipped and the scale backs off), not an anomaly to roll back for. Its loss
    is still judged: a non-finite loss or a loss spike remains an anomaly."""
    return jnp.where(overflow, jnp.zeros_like(grad_norm), grad_norm)
