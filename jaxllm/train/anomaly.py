"""Anomaly detection inside the compiled step, and its replay over recorded traces.

A step is flagged when its loss or gradient norm is non-finite, or when either jumps far above the recent healthy
steps. Only non-finite values and loss spikes are acted on by default (rollback, skip or abort, per
`train.on_anomaly`): a gradient-norm excursion is what clipping already bounds, and healthy runs of the default
job showed single batches with 4-6x the usual gradient norm (and 1.13x the usual loss) that training absorbed
without harm. Gradient-norm spikes are still counted and reported (`anomaly.act_on_grad_spike` acts on them).

Spikes are judged on the log scale: loss and gradient norm are positive and their batch-to-batch noise is
multiplicative, so "how many times the recent level" is the meaningful size of a jump.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.config.schema import AnomalyConfig


def window_stats(window):
    """(count, mean, std) of the non-NaN entries of a history window."""
    valid = jnp.isfinite(window)
    count = jnp.sum(valid)
    mean = jnp.sum(jnp.where(valid, window, 0.0)) / jnp.maximum(count, 1)
    var = jnp.sum(jnp.where(valid, (window - mean) ** 2, 0.0)) / jnp.maximum(count, 1)
    return count, mean, jnp.sqrt(var)


def is_spike(value, window, z: float, min_history: int, min_ratio: float):
    """Whether positive `value` jumps above the history `window` (NaN = empty slot) on the log scale: more than
    `z` standard deviations of the log history above its mean, and at least `min_ratio` times its geometric
    mean. Never with fewer than `min_history` known steps."""
    logs = jnp.log(jnp.maximum(window, 1e-30))
    count, mean, std = window_stats(jnp.where(jnp.isfinite(window), logs, jnp.nan))
    excess = jnp.log(jnp.maximum(value, 1e-30)) - mean
    return (count >= min_history) & (excess > jnp.maximum(z * std, jnp.log(min_ratio)))


def push(window, value, keep):
    """Append `value` to the ring buffer (oldest dropped) when `keep`."""
    return jnp.where(keep, jnp.concatenate([window[1:], value[None].astype(window.dtype)]), window)


def empty_window(size: int) -> jax.Array:
    return jnp.full((size,), jnp.nan, jnp.float32)


def detect(loss, grad_norm, loss_window, grad_window, cfg: AnomalyConfig) -> dict:
    """Flags of one step (device booleans): `nonfinite`, `loss_spike`, `grad_spike`, and `anomaly`, the ones
    acted on. Healthy steps are those not acted on; only they enter the windows."""
    nonfinite = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    loss_spike = ~nonfinite & is_spike(loss, loss_window, cfg.z, cfg.min_history, cfg.loss_ratio)
    grad_spike = ~nonfinite & is_spike(grad_norm, grad_window, cfg.grad_z, cfg.min_history, cfg.grad_ratio)
    acted = (nonfinite | (loss_spike if cfg.act_on_loss_spike else False)
             | (grad_spike if cfg.act_on_grad_spike else False))
    return {"anomaly": acted, "nonfinite": nonfinite, "loss_spike": loss_spike, "grad_spike": grad_spike}


def replay(losses, grad_norms, cfg: AnomalyConfig) -> list[tuple[int, str, bool]]:
    """(index, kind, acted on) of every step that `detect` flags over recorded traces, with the windows updated
    as the train step updates them: acted-on steps leave the windows untouched. `kind` names the incident (see
    `incident_kind`)."""
    flags = jax.device_get(_replay_flags(cfg, jnp.asarray(losses, jnp.float32), jnp.asarray(grad_norms, jnp.float32)))
    return [(i, incident_kind({k: v[i] for k, v in flags.items()}), bool(flags["anomaly"][i]))
            for i in range(len(losses)) if flags["anomaly"][i] or flags["grad_spike"][i]]


@functools.partial(jax.jit, static_argnums=0)
def _replay_flags(cfg: AnomalyConfig, losses, grad_norms):
    def step(carry, xs):
        loss_window, grad_window = carry
        loss, grad_norm = xs
        flags = detect(loss, grad_norm, loss_window, grad_window, cfg)
        healthy = ~flags["anomaly"]
        return (push(loss_window, loss, healthy), push(grad_window, grad_norm, healthy)), flags

    carry = (empty_window(cfg.window), empty_window(cfg.window))
    return jax.lax.scan(step, carry, (losses, grad_norms))[1]


def incident_kind(flags: dict) -> str:
    """The name of a flagged step's incident: the most severe flag it raised."""
    return "nonfinite" if flags["nonfinite"] else "loss_spike" if flags["loss_spike"] else "grad_spike"


