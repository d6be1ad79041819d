"""Layout invariance: the same model, data and seed give the same losses and gradients on every mesh."""

import jax
import numpy as np
import pytest

from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.pretrain import create_train_state
from jaxllm.model.head import next_token_loss
from jaxllm.train.step import batch_sharding, grads_and_loss, jit_train_step, make_train_step

LAYOUTS = [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (1, 2, 4, 1)]
# Heads and kv heads divisible by tensor=4; GQA with 2 query heads per kv head.
MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, mlp_dim=128)
PRECISION = PrecisionConfig(params="float32", compute="float32", output="float32")


def _global(batch, mesh):
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def _run(layout):
    mesh = make_mesh(MeshConfig(*layout))
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    with jax.set_mesh(mesh):
        graphdef, state, shardings = create_train_state(MODEL, PRECISION, tx, mesh, seed=0)
        grad_fn = jax.jit(lambda p, b: grads_and_loss(graphdef, p, b, 1, loss_fn=next_token_loss)[0])
        grads = jax.device_get(grad_fn(state.params, _global(synthetic_batch(99, 8, 32, 256), mesh)))
        step = jit_train_step(make_train_step(lm_objective(MODEL, PRECISION), tx, grad_accum=2), shardings, mesh)
        losses = []
        batch = _global(synthetic_batch(1, 8, 32, 256), mesh)  # repeated, so the loss must fall
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, grads


@pytest.fixture(scope="module")
def results():
    return {layout: _run(layout) for layout in LAYOUTS}


def test_losses_agree_across_layouts(results):
    reference, _ = results[LAYOUTS[0]]
    assert reference[2] < reference[0]  # the steps did train
    for layout in LAYOUTS[1:]:
        np.testing.assert_allclose(results[layout][0], reference, rtol=1e-5, err_msg=str(layout))


def test_gradients_agree_across_layouts(results):
    _, reference = results[LAYOUTS[0]]
    ref_leaves = jax.tree.leaves(reference)
    assert sum(float(np.abs(g).sum()) for g in ref_leaves) > 0
    for layout in LAYOUTS[1:]:
        leaves = jax.tree.leaves(results[layout][1])
        assert len(leaves) == len(ref_leaves)
        for got, want in zip(leaves, ref_leaves):
            scale = np.max(np.abs(want)) + 1e-12
            np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=1e-5, err_msg=str(layout))


def test_every_new_axis_above_1_at_once_equals_the_plain_layout():
    """The combined layout of the mixture-of-experts, context-parallel and pipeline-schedule issues, as far as 8
    devices allow (three axes of 2): a mixture of experts on expert x context x stage through 1F1B (each axis at
    2), and the dense model with ring attention on context 4 x stage 2 through ZB-H1 (a ring of 2 cannot tell its
    direction); the stacked layers split over stage; three updates' losses equal data 8's. (GPipe runs experts
    with stages in tests/test_moe_models.py, and context with stages in tests/test_context.py.)"""
    import dataclasses

    from jaxllm.config.presets import PRESETS
    from jaxllm.config.schema import PipelineConfig

    from layout_steps import first_updates

    moe = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=256, moe_aux_loss_coef=0.1))
    batch = synthetic_batch(3, 8, 16, 256)
    runs = [(moe, "1f1b", MeshConfig(expert=2, context=2, stage=2)),
            (dataclasses.replace(MODEL, context_attention="ring"), "zb_h1", MeshConfig(context=4, stage=2))]
    references = {}
    for model, schedule, mesh in runs:
        def objective_for(pipeline, model=model, schedule=schedule):
            return lm_objective(model, PRECISION, PipelineConfig(pipeline.microbatches, schedule=schedule))

        # An explicit schedule's load-balancing loss is each pipeline micro-batch's, as under accumulation
        # (docs/pipeline.md): its reference accumulates over as many micro-batches (2 x 2).
        accum = 4 if schedule != "gpipe" and model.num_experts else 2
        if (model, accum) not in references:
            references[model, accum] = first_updates(objective_for, MeshConfig(data=8), batch, grad_accum=accum)
        reference = references[model, accum]
        assert reference[2] < reference[0]  # it trains
        np.testing.assert_allclose(first_updates(objective_for, mesh, batch), reference, rtol=1e-5,
                                   err_msg=f"{schedule} on {mesh}")
