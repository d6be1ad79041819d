"""Plan a run without allocating it: parameter count and per-device bytes of parameters and optimizer state
for any mesh, including meshes far larger than this machine (an AbstractMesh has no devices)."""

from __future__ import annotations

import math

import jax

from jaxllm.config import Config
from jaxllm.mesh import abstract_mesh
from jaxllm.optim import make_optimizer
from jaxllm.sharding import bytes_per_device
from jaxllm.train.state import abstract_train_state


def memory_plan(cfg: Config) -> dict:
    """Parameter count, and bytes per device of parameters and optimizer state, on `cfg.mesh`."""
    mesh = abstract_mesh(cfg.mesh)
    state = abstract_train_state(cfg.model, cfg.precision, make_optimizer(cfg.optim, cfg.train.steps))
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    return dict(
        preset=cfg.model.preset or "custom",
        mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)),
        num_params=num_params,
        param_bytes_per_device=bytes_per_device(state.params, mesh),
        opt_bytes_per_device=bytes_per_device(state.opt_state, mesh),
        param_bytes_total=sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
    )


def format_plan(plan: dict) -> str:
    gib = 1024**3
    per_device = plan["param_bytes_per_device"] + plan["opt_bytes_per_device"]
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    return (
        f"model {plan['preset']}: {plan['num_params']:,} parameters ({plan['num_params'] / 1e9:.2f} B)\n"
        f"mesh {mesh} ({math.prod(plan['mesh'].values())} devices)\n"
        f"per device: parameters {plan['param_bytes_per_device'] / gib:.3f} GiB + optimizer state "
        f"{plan['opt_bytes_per_device'] / gib:.3f} GiB = {per_device / gib:.3f} GiB "
        f"(activations not included)"
    )
