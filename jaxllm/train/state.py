"""The train state, born sharded: abstract shapes first, shardings from the rules table, then a jitted init
whose outputs land directly in their shards (no device ever holds an unsharded copy)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxllm.config import ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.model.transformer import Transformer
from jaxllm.sharding import sharding_tree


@struct.dataclass
class TrainState:
    """Everything the train step updates and a checkpoint holds.

    `lr_scale` multiplies every update (recovery policies lower it; it survives restarts). `loss_window` and
    `grad_window` hold the last healthy steps' loss and gradient norm (NaN = empty) for spike detection inside
    the step. `inject` is a one-shot fault-injection code for drills (0 none, 1 NaN gradients, 2 loss spike).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    lr_scale: jax.Array
    loss_window: jax.Array
    grad_window: jax.Array
    inject: jax.Array


def build_model(cfg: ModelConfig, precision: PrecisionConfig, key: jax.Array,
                pipeline: PipelineConfig = PipelineConfig()) -> Transformer:
    """Construct the model without flax's eager sharding: placement is decided by `jaxllm.sharding` instead."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, precision, rngs=nnx.Rngs(params=key), pipeline_microbatches=pipeline.microbatches,
                           pipeline_repeats=pipeline.repeats)


def abstract_model(cfg: ModelConfig, precision: PrecisionConfig,
                   pipeline: PipelineConfig = PipelineConfig()) -> Transformer:
    """The model with ShapeDtypeStructs in place of arrays: no memory allocated.

    Plain `jax.eval_shape` rather than `nnx.eval_shape`: the latter resolves `out_sharding` names against the
    active mesh itself, and in jaxllm logical names are resolved by `jaxllm.sharding` only.
    """
    graphdef, state = jax.eval_shape(lambda: nnx.split(build_model(cfg, precision, jax.random.key(0), pipeline)))
    return nnx.merge(graphdef, state)


def _init_fn(cfg: ModelConfig, precision: PrecisionConfig, tx: optax.GradientTransformation, window: int,
             pipeline: PipelineConfig = PipelineConfig()):
    def init(key):
        params = nnx.state(build_model(cfg, precision, key, pipeline))
        empty = jnp.full((window,), jnp.nan, jnp.float32)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          lr_scale=jnp.ones((), jnp.float32), loss_window=empty, grad_window=empty,
                          inject=jnp.zeros((), jnp.int32))

    return init


def abstract_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx, window: int = 50) -> TrainState:
    """Shapes and dtypes of the whole train state (parameters and optimizer state), without allocating it."""
    return jax.eval_shape(_init_fn(cfg, precision, tx, window), jax.random.key(0))


def create_train_state(cfg: ModelConfig, precision: PrecisionConfig, tx, mesh, seed: int, window: int = 50,
                       pipeline: PipelineConfig = PipelineConfig()):
    """Initialise the train state directly into its shards on `mesh`.

    Returns (graphdef, state, state_shardings); `nnx.merge(graphdef, state.params)` rebuilds the model (the
    pipeline schedule lives in the graphdef; parameters are laid out the same for every schedule).
    """
    graphdef = nnx.graphdef(abstract_model(cfg, precision, pipeline))
    shardings = sharding_tree(abstract_train_state(cfg, precision, tx, window), mesh)
    init = jax.jit(_init_fn(cfg, precision, tx, window, pipeline), out_shardings=shardings)
    state = init(jax.random.key(seed))
    return graphdef, state, shardings
