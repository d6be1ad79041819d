"""The first updates of an objective on one fixed batch under a given mesh layout, for the layout-parity tests of
the RL objectives (tests/test_grpo.py, tests/test_ppo.py): sampling itself differs across layouts, so they
compare updates on the same rollout rows."""

import jax

from jaxllm.config.schema import MeshConfig, OptimConfig, PipelineConfig
from jaxllm.parallel.mesh import make_mesh
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.host_rows import to_global
from jaxllm.train.state import init_objective_state
from jaxllm.train.step import batch_sharding, jit_train_step, make_train_step


def first_updates(objective_for, layout: tuple, batch: dict, names=("loss",), steps: int = 3,
                  grad_accum: int = 2) -> tuple:
    """`names` metrics of `steps` updates (`grad_accum` micro-batches each) on `batch` under mesh `layout` ((data,
    fsdp, tensor, stage), or a MeshConfig); `objective_for(pipeline)` builds the objective (2 pipeline
    micro-batches with stages)."""
    layout = layout if isinstance(layout, MeshConfig) else MeshConfig(*layout)
    mesh = make_mesh(layout)
    objective = objective_for(PipelineConfig(microbatches=2) if layout.stage > 1 else PipelineConfig())
    tx = make_optimizer(OptimConfig(lr=3e-2, warmup_steps=0), 10)
    rows = len(next(iter(batch.values())))
    with jax.set_mesh(mesh):
        state, frozen, shardings, frozen_shardings = init_objective_state(objective, tx, mesh, seed=0)
        step = jit_train_step(make_train_step(objective, tx, grad_accum=grad_accum), shardings, mesh, frozen_shardings)
        placed = to_global(batch, batch_sharding(mesh), rows)
        out = []
        for _ in range(steps):
            state, metrics = step(state, placed, frozen)
            out.append(tuple(float(metrics[name]) for name in names))
    return tuple(out)
