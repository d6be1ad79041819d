"""The train state, born sharded: abstract shapes first, shardings from the rules table, then a jitted init
whose outputs land directly in their shards (no device ever holds an unsharded copy)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxllm.config import ModelConfig, PrecisionConfig
from jaxllm.model.transformer import Transformer
from jaxllm.sharding import sharding_tree


@struct.dataclass
class TrainState:
    """Everything the train step updates: step counter, parameters (an nnx.State) and optimizer state."""

    step: jax.Array
    params: Any
    opt_state: Any


def build_model(cfg: ModelConfig, precision: PrecisionConfig, key: jax.Array) -> Transformer:
    """Construct the model without flax's eager sharding: placement is decided by `jaxllm.sharding` instead."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, precision, rngs=nnx.Rngs(params=key))


def abstract_model(cfg: ModelConfig, precision: PrecisionConfig) -> Transformer:
    """The model with ShapeDtypeStructs in place of arrays: no memory allocated.

    Plain `jax.eval_shape` rather than `nnx.eval_shape`: the latter resolves `out_sharding` names against the
    active mesh itself, and in jaxllm logical names are resolved by `jaxllm.sharding` only.
    """
    graphdef, state = jax.eval_shape(lambda: nnx.split(build_model(cfg, precision, jax.random.key(0))))
    return nnx.merge(graphdef, state)


def _init_fn(cfg: ModelConfig, precision: PrecisionConfig, tx: optax.GradientTransformation):
    def init(key):
        params = nnx.state(build_model(cfg, precision, key))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    return init


def abstract_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx) -> TrainState:
    """Shapes and dtypes of the whole train state (parameters and optimizer state), without allocating it."""
    return jax.eval_shape(_init_fn(cfg, precision, tx), jax.random.key(0))


def create_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx, mesh, seed: int):
    """Initialise the train state directly into its shards on `mesh`.

    Returns (graphdef, state, state_shardings); `nnx.merge(graphdef, state.params)` rebuilds the model.
    """
    graphdef = nnx.graphdef(abstract_model(cfg, precision))
    shardings = sharding_tree(abstract_train_state(cfg, precision, tx), mesh)
    init = jax.jit(_init_fn(cfg, precision, tx), out_shardings=shardings)
    state = init(jax.random.key(seed))
    return graphdef, state, shardings
