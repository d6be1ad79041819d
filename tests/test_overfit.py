"""A tiny model memorises one repeated batch: the whole train step (loss, grads, AdamW, schedule) learns."""

import jax
import numpy as np

from jaxllm.config.schema import MeshConfig, ModelConfig, OptimConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.objectives.pretrain import lm_objective
from jaxllm.objectives.pretrain import create_train_state
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step


def test_overfit_one_batch_below_0_1():
    model = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    precision = PrecisionConfig(params="float32", compute="float32", output="float32")
    steps = 150
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=10, schedule="constant", weight_decay=0.0), steps)
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    local = synthetic_batch(7, 8, 32, 128)
    with jax.set_mesh(mesh):
        _, state, shardings = create_train_state(model, precision, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(lm_objective(model, precision), tx), shardings, mesh)
        sharding = batch_sharding(mesh)
        batch = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
        losses = []
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))  # one step in flight at a time
    losses = np.asarray(losses)
    assert losses[0] > 4.0  # ~ln(128) at init
    assert losses[-1] < 0.1, losses[-10:]
