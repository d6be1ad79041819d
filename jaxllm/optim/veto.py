"""An optimizer update the train step can veto (anomaly, loss-scale overflow, PPO's early stop) at no extra cost.

A vetoed step keeps the parameters and the whole optimizer state. Selecting the old state after the update
(`where(veto, old, new)` over every leaf) is correct but not free: XLA then materialises each new Adam moment in a
temporary, computes the update from it, and runs one more pass per moment to select it into the output buffer, and
on 8 data-parallel CPU devices those passes cost a sixth of the step (bf16, scripts/bench_peers.py, 0.80 vs 0.96 of
the bare step). Here the moments are vetoed where Adam computes them: the select is part of the moment update's
own fused kernel, written once in place, and the update is computed from the kept moments (an update the step
drops anyway). The few scalars around them (step counts, schedule states, hyperparameters) are selected
afterwards, which costs nothing.

`scale_by_adam` is optax's own arithmetic (its tree utilities, in its order), so an unvetoed step is bitwise
optax's; AdamW and LAMB are built on it (`jaxllm.optim.chain`). An optimizer without vetoable moments (Adafactor,
a plain optax transformation) is vetoed by the generic select in the step, at the cost above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


class VetoableTransformation(optax.GradientTransformationExtraArgs):
    """A transformation whose `update(grads, state, params, veto=pred)` returns, when the scalar `pred` is true,
    the state it was given (every leaf) and updates the caller must drop; `veto=None` is a plain update."""


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformationExtraArgs:
    """`optax.scale_by_adam` (same state, same arithmetic) with a `veto` extra argument: a vetoed step keeps
    the moments and the count, and its updates (computed from the kept moments) are meant to be dropped.

    The kept moments pass an optimization barrier: without it XLA fuses the select into both of its consumers
    (the state output and the update), reads the old moment after the output overwrote it in place, and so
    copies every moment on entry."""
    base = optax.scale_by_adam(b1, b2, eps)

    def update_fn(updates, state, params=None, veto=None, **extra_args):
        del params, extra_args
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count_inc = optax.safe_increment(state.count)
        count = count_inc
        if veto is not None:
            mu, nu, count = keep_if(veto, (state.mu, state.nu, state.count), (mu, nu, count_inc))
        mu, nu = jax.lax.optimization_barrier((mu, nu))
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)  # optax's eps_root 0
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=optax.tree.cast_like(nu, state.nu))

    return optax.GradientTransformationExtraArgs(base.init, update_fn)


def keep_if(veto, old, new):
    """`old` where the scalar `veto` is true, else `new`, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(veto, o, n), new, old)


def vetoable(tx: optax.GradientTransformation) -> VetoableTransformation:
    """`tx` (built on `scale_by_adam` above) with the veto completed: its Adam moments are vetoed by the Adam
    itself, every other leaf of the state (counts, schedule states, injected hyperparameters, scalars all) is
    selected here."""
    inner = optax.with_extra_args_support(tx)

    def update_fn(updates, state, params=None, veto=None, **extra_args):
        new_updates, new_state = inner.update(updates, state, params, veto=veto, **extra_args)
        if veto is None:
            return new_updates, new_state
        return new_updates, jax.tree.map(lambda n, o: _keep_all_but_moments(veto, o, n), new_state, state,
                                         is_leaf=_is_adam_state)

    return VetoableTransformation(tx.init, update_fn)


def _is_adam_state(x) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _keep_all_but_moments(veto, old, new):
    if _is_adam_state(new):  # `scale_by_adam` vetoed these itself
        return new
    return jnp.where(veto, old, new)
