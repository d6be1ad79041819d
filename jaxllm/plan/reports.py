"""The plans `scripts/train.py` prints and exits (nothing allocated): `--print_memory`, the largest buffers of a
run's abstract train state, and `--print_comms`, the collectives of its train step compiled ahead of time."""

from __future__ import annotations

from flax import nnx

from jaxllm.model.build import abstract_model
from jaxllm.objectives.registry import planned_model
from jaxllm.observe.comms import step_comms
from jaxllm.observe.memory import buffer_rows, format_buffers
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.mesh import run_mesh
from jaxllm.plan.footprint import compiled_step
from jaxllm.train.state import abstract_objective_state, state_shardings


def memory_report(cfg, count: int = 20) -> str:
    """`format_buffers` of the run `cfg` (a planned config: `jaxllm.objectives.registry.resolved_shape`)
    describes, from the abstract train state of the model that trains: nothing is allocated, and no data is
    prepared or read."""
    objective = planned_model(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state, frozen = abstract_objective_state(objective, tx, cfg.anomaly.window)
    mesh = run_mesh(cfg)  # an RL run's trainer mesh leaves out the devices set aside for rollouts
    return format_buffers(buffer_rows(state, frozen, mesh, state_shardings(state, mesh, cfg.optim.offload,
                                                                         cfg.optim.zero1)), count)


def comms_report(cfg) -> dict:
    """`step_comms` of the train step of `cfg` compiled ahead of time on this machine's first
    `cfg.mesh.num_devices` devices (nothing allocated)."""
    return step_comms(compiled_step(cfg), cfg.mesh.shape, nnx.state(abstract_model(cfg.model, cfg.precision)))
