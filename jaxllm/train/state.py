"""The train state, born sharded: abstract shapes first, shardings from the rules table, then a jitted init
whose outputs land directly in their shards (no device ever holds an unsharded copy).

The state holds the trainable variables only; an objective's frozen variables (a LoRA base, a reference model)
are a separate tree, passed to the step as an input that is never donated, differentiated or optimised.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.optim import powersgd
from jaxllm.optim.loss_scale import LossScale, new_loss_scale
from jaxllm.parallel.offload import host_shardings
from jaxllm.optim.chain import current_clip_norm, with_clip_norm, without_clip_norm
from jaxllm.parallel.sharding import sharding_tree, spec_tree, split_over_replicas
from jaxllm.train.anomaly import empty_window


@struct.dataclass
class TrainState:
    """Everything the train step updates and a checkpoint holds.

    `params` are the objective's trainable variables and `opt_state` their optimizer state (with the learning
    rate and the clipping threshold as hyperparameters, jaxllm/optim/chain.py). `lr_scale` multiplies every update
    (recovery lowers it, hot updates change it; it survives restarts). `rng` is the run's key data: step N
    draws from `fold_in(rng, N)`, so dropout resumes bitwise. `loss_window` and `grad_window` hold the last
    healthy steps' loss and gradient norm (NaN = empty) for the anomaly checks inside the step. `loss_scale` is
    float16 loss scaling's scale and counter (jaxllm/optim/loss_scale.py; 1.0 and never read without scaling).
    `powersgd` is the gradient compression's state (`jaxllm.optim.powersgd.PowerSGDState`; None without compression).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    lr_scale: jax.Array
    rng: jax.Array
    loss_window: jax.Array
    grad_window: jax.Array
    loss_scale: LossScale
    powersgd: Any = None

    def step_key(self) -> jax.Array:
        """The key of the step this state's next update is (derived, never stored)."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def new_train_state(params, tx: optax.GradientTransformation, seed, window: int, init_scale: float = 1.0) -> TrainState:
    """A state at step 0 around `params`, its loss scale at `init_scale` (`LossScaling.init_scale`); traceable:
    jit it with out-shardings to create it in place."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      lr_scale=jnp.ones((), jnp.float32), rng=jax.random.key_data(jax.random.key(seed)),
                      loss_window=empty_window(window), grad_window=empty_window(window),
                      loss_scale=new_loss_scale(init_scale))


def older_layout(abstract_state: TrainState, shardings: TrainState, clip_norm: float) -> tuple:
    """(abstract state, shardings, upgrade) of train states that jaxllm saved before the clipping threshold
    moved into the optimizer state, for `Checkpointer.restore(older=...)`: `upgrade` adds the threshold
    `clip_norm` (the configured `optim.clip_norm`, which such a run's step had baked in)."""
    def upgrade(state: TrainState) -> TrainState:
        value = jax.device_put(np.float32(clip_norm), current_clip_norm(shardings.opt_state))
        return state.replace(opt_state=with_clip_norm(state.opt_state, value))

    return (abstract_state.replace(opt_state=without_clip_norm(abstract_state.opt_state)),
            shardings.replace(opt_state=without_clip_norm(shardings.opt_state)), upgrade)


def abstract_objective_state(objective, tx, window: int = 50) -> tuple[TrainState, Any]:
    """(train state, frozen variables) of `objective` as ShapeDtypeStructs: nothing allocated."""
    def init():
        _, params, frozen = objective.split(objective.build_model(jax.random.key(0)))
        return new_train_state(params, tx, 0, window), frozen

    return jax.eval_shape(init)


def state_shardings(abstract_state: TrainState, mesh, offload: str = "none", zero1: bool = False) -> TrainState:
    """The train state's shardings on `mesh` (the RULES placement); with `zero1` (`optim.zero1`) the optimizer
    state is split over the data-parallel replicas as well (`jaxllm.parallel.sharding.split_over_replicas`);
    with `offload="host"` (`optim.offload`) it is in pinned host memory. Every placement of a train state
    (init, the step, checkpoint restore) takes its shardings from here."""
    shardings = sharding_tree(abstract_state, mesh)
    if zero1:
        shardings = shardings.replace(opt_state=jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), opt_state_specs(abstract_state.opt_state, mesh, zero1),
            is_leaf=lambda x: isinstance(x, PartitionSpec)))
    if abstract_state.powersgd is not None:
        shardings = shardings.replace(powersgd=powersgd.state_shardings(abstract_state.powersgd,
                                                                        abstract_state.params, mesh))
    if offload == "host":
        shardings = shardings.replace(opt_state=host_shardings(shardings.opt_state))
    return shardings


def opt_state_specs(opt_state, mesh, zero1: bool):
    """The PartitionSpecs of an optimizer state on `mesh`: the RULES placement, split over the data-parallel
    replicas with `zero1` (`optim.zero1`)."""
    return split_over_replicas(opt_state, mesh) if zero1 else spec_tree(opt_state, mesh)


def init_objective_state(objective, tx, mesh, seed: int, window: int = 50, offload: str = "none",
                         init_scale: float = 1.0, zero1: bool = False):
    """(state, frozen, state shardings, frozen shardings): `objective`'s model initialised from `seed` directly
    into its shards on `mesh`, with a fresh optimizer state for its trainable variables (placed by `offload`
    and `zero1`, see `state_shardings`) and the loss scale at `init_scale`."""
    state, frozen = abstract_objective_state(objective, tx, window)
    shardings = state_shardings(state, mesh, offload, zero1), sharding_tree(frozen, mesh)

    def init(key):
        _, params, frozen = objective.split(objective.build_model(key))
        return new_train_state(params, tx, seed, window, init_scale), frozen

    state, frozen = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
    return state, frozen, *shardings


def init_part(part_of, mesh, seed: int):
    """`part_of(key)` (a part of a model's initialisation) computed into its shards; XLA drops the rest."""
    shardings = sharding_tree(jax.eval_shape(part_of, jax.random.key(0)), mesh)
    return jax.jit(part_of, out_shardings=shardings)(jax.random.key(seed))


def init_frozen(objective, mesh, seed: int):
    """`objective`'s frozen variables alone, initialised from `seed` into their shards exactly as
    `init_objective_state` makes them; the trainable variables are never materialised."""
    return init_part(lambda key: objective.split(objective.build_model(key))[2], mesh, seed)


def init_trainable_state(objective, tx, shardings: TrainState, seed: int, window: int = 50,
                         init_scale: float = 1.0) -> TrainState:
    """`objective`'s train state alone (fresh trainable variables, as `init_objective_state` makes them, and
    their optimizer state), created into `shardings` (`state_shardings`); the frozen variables are never
    materialised (a pretrained base is loaded instead)."""
    def init(key):
        return new_train_state(objective.split(objective.build_model(key))[1], tx, seed, window, init_scale)

    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def state_from_params(params, tx, shardings: TrainState, seed: int, window: int = 50,
                      init_scale: float = 1.0) -> TrainState:
    """A step-0 state around already placed `params` (restored from another run): no second copy is made."""
    return jax.jit(lambda p: new_train_state(p, tx, seed, window, init_scale), out_shardings=shardings)(params)


