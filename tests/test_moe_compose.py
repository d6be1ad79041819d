"""A mixture of experts composed with the rest of the framework: LoRA adapters on the attention of an MoE model
train alike on every expert layout, and PowerSGD across `data` at full rank trains an MoE model like uncompressed
data parallelism while its experts are split over `expert`."""

import dataclasses

import jax
import numpy as np
import optax

from jaxllm.config.presets import PRESETS
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.optim import powersgd
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.state import init_objective_state, state_shardings
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step

from layout_steps import first_updates

F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
VOCAB, ROWS, SEQ = 128, 8, 16
MOE = ModelConfig(**dict(PRESETS["moe_tiny"], vocab_size=VOCAB, moe_aux_loss_coef=0.1))


def test_lora_on_the_attention_of_a_mixture_trains_alike_on_every_expert_layout():
    """Adapters on q, k, v and o of moe_tiny (the experts and routers frozen in the base): 3 updates' losses on
    expert = 1 (data 8), expert = 2 with fsdp and expert = 4 with tensor agree to 1e-5, and they move."""
    lora = LoRAConfig(rank=4, dropout=0.0, targets="q_proj,k_proj,v_proj,o_proj")
    objective_for = lambda pipeline: lm_objective(MOE, F32, pipeline, lora=lora)  # noqa: E731
    batch = synthetic_batch(0, ROWS, SEQ, VOCAB)
    runs = {name: first_updates(objective_for, layout, batch) for name, layout in (
        ("data8", MeshConfig(8)), ("expert2-fsdp2", MeshConfig(2, 2, expert=2)),
        ("expert4-tensor2", MeshConfig(1, 1, 2, expert=4)))}
    reference = np.array(runs["data8"])
    assert len(set(reference[:, 0])) == 3, reference  # the adapters train: each step's loss differs
    for name, losses in runs.items():
        np.testing.assert_allclose(np.array(losses), reference, rtol=1e-5, err_msg=name)


def _powersgd_run(compression, steps=3):
    """(parameters, losses) of `steps` SGD updates of moe_tiny (no auxiliary loss) on one batch over data 4 x
    expert 2."""
    mesh = make_mesh(MeshConfig(4, 1, expert=2))
    model = dataclasses.replace(MOE, moe_aux_loss_coef=0.0)
    objective, tx = lm_objective(model, F32), optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    with jax.set_mesh(mesh):
        state, _, shardings, _ = init_objective_state(objective, tx, mesh, seed=0)
        shardings = state_shardings(powersgd.with_state(jax.eval_shape(lambda: state), compression, mesh), mesh)
        state = powersgd.with_state(state, compression, mesh, shardings)
        step = jit_train_step(make_train_step(objective, tx, compression=compression), shardings, mesh)
        batch = to_global(synthetic_batch(0, ROWS, SEQ, VOCAB), batch_sharding(mesh), ROWS)
        losses = []
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def test_full_rank_powersgd_over_data_trains_a_mixture_like_uncompressed():
    """SGD (Adam would turn float32 noise on an unused expert's zero gradient into a full step) at rank 64, at
    least every gradient matrix's rank, from step 0: the same losses and parameters as without compression; a
    rank-1 run differs, so the compression did run. Without the auxiliary loss: under PowerSGD each data shard's
    gradients are its own, so the load-balancing loss is each shard's (as under torch DDP), not the global
    batch's; with moe_aux_loss_coef 0.1 the losses here part by 4e-4 relative at step 2 (docs/training.md)."""
    plain_params, plain = _powersgd_run(None)
    params, compressed = _powersgd_run(powersgd.PowerSGD(rank=64, start_step=0))
    np.testing.assert_allclose(compressed, plain, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(plain_params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    _, low_rank = _powersgd_run(powersgd.PowerSGD(rank=1, start_step=0))
    assert abs(low_rank[-1] - plain[-1]) > 1e-4, (low_rank, plain)
