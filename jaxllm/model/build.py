"""Building a model from its config: `build_model` constructs it without flax's eager sharding (placement is
jaxllm.parallel.sharding's), `abstract_model` gives its shapes without allocating anything."""

from __future__ import annotations

import jax
from flax import nnx

from jaxllm.config.schema import LoRAConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.model.transformer import Transformer


def build_model(cfg: ModelConfig, precision: PrecisionConfig, key: jax.Array,
                pipeline: PipelineConfig = PipelineConfig(), lora: LoRAConfig | None = None,
                rope_scaling=None, model_class=Transformer, sequence_parallel: bool = False) -> Transformer:
    """Construct the model (`model_class`: the LM, or jaxllm.model.reward.RewardModel) without flax's eager
    sharding: placement is decided by `jaxllm.parallel.sharding` instead. `sequence_parallel` is
    `config.MeshConfig.sequence_parallel`: a static layout choice that leaves the parameters unchanged."""
    with nnx.use_eager_sharding(False):
        return model_class(cfg, precision, rngs=nnx.Rngs(params=key), pipeline_microbatches=pipeline.microbatches,
                           pipeline_repeats=pipeline.repeats, lora=lora, rope_scaling=rope_scaling,
                           sequence_parallel=sequence_parallel, pipeline_schedule=pipeline.schedule)


def abstract_model(cfg: ModelConfig, precision: PrecisionConfig,
                   pipeline: PipelineConfig = PipelineConfig()) -> Transformer:
    """The model with ShapeDtypeStructs in place of arrays: no memory allocated.

    Plain `jax.eval_shape` rather than `nnx.eval_shape`: the latter resolves `out_sharding` names against the
    active mesh itself, and in jaxllm logical names are resolved by `jaxllm.parallel.sharding` only.
    """
    graphdef, state = jax.eval_shape(lambda: nnx.split(build_model(cfg, precision, jax.random.key(0), pipeline)))
    return nnx.merge(graphdef, state)
