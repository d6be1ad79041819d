"""Plan a run without allocating it: parameter counts (all, trainable) and per-device bytes of the frozen and
trainable parameters and the optimizer state for any mesh, including meshes far larger than this machine (an
AbstractMesh has no devices). A LoRA fine-tuning config (train.objective="sft", lora.rank > 0) plans the base
frozen and the adapters trainable."""

from __future__ import annotations

import math

import jax

from jaxllm.config import Config
from jaxllm.mesh import abstract_mesh
from jaxllm.optim import make_optimizer
from jaxllm.sharding import bytes_per_device
from jaxllm.train.pretrain import lm_objective
from jaxllm.train.state import abstract_objective_state


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def memory_plan(cfg: Config) -> dict:
    """Parameter counts, and bytes per device of parameters (frozen, trainable) and optimizer state, on
    `cfg.mesh`."""
    mesh = abstract_mesh(cfg.mesh)
    lora = cfg.lora if cfg.train.objective == "sft" and cfg.lora.rank else None
    objective = lm_objective(cfg.model, cfg.precision, lora=lora)
    state, frozen = abstract_objective_state(objective, make_optimizer(cfg.optim, cfg.train.steps))
    trainable = _count(state.params)
    every = jax.tree.leaves((state.params, frozen))
    return dict(
        preset=cfg.model.preset or "custom",
        mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)),
        num_params=trainable + _count(frozen),
        trainable_params=trainable,
        frozen_bytes_per_device=bytes_per_device(frozen, mesh) if jax.tree.leaves(frozen) else 0,
        param_bytes_per_device=bytes_per_device(state.params, mesh),
        opt_bytes_per_device=bytes_per_device(state.opt_state, mesh),
        param_bytes_total=sum(math.prod(x.shape) * x.dtype.itemsize for x in every),
    )


def _size(n: int) -> str:
    return f"{n / 1024**3:.3f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.3f} MiB"


def format_plan(plan: dict) -> str:
    frozen, trainable, opt = (plan[k] for k in ("frozen_bytes_per_device", "param_bytes_per_device",
                                                "opt_bytes_per_device"))
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    share = plan["trainable_params"] / plan["num_params"]
    params = (f"frozen parameters {_size(frozen)} + trainable parameters {_size(trainable)}"
              if frozen else f"parameters {_size(trainable)}")
    return (
        f"model {plan['preset']}: {plan['num_params']:,} parameters ({plan['num_params'] / 1e9:.2f} B), "
        f"{plan['trainable_params']:,} trainable ({100 * share:.3g}%)\n"
        f"mesh {mesh} ({math.prod(plan['mesh'].values())} devices)\n"
        f"per device: {params} + optimizer state {_size(opt)} = {_size(frozen + trainable + opt)} "
        f"(activations not included)"
    )
