"""Plan a run without allocating it: parameter counts (all, trainable) and per-device bytes of the frozen and
trainable parameters and the optimizer state for any mesh, including meshes far larger than this machine (an
AbstractMesh has no devices). A LoRA fine-tuning config (train.objective="sft", lora.rank > 0) plans the base
frozen and the adapters trainable. `compiled_step_memory` adds what only a compile knows (activations and
temporaries), from an ahead-of-time compile of the real train step on this machine's devices. What host offload
(`optim.offload`, `model.remat_offload`) keeps in pinned host memory counts as host bytes, not device bytes."""

from __future__ import annotations

import math

import jax

from jaxllm.model.base_quant import as_float
from jaxllm.optim import powersgd
from jaxllm.plan.activation_memory import host_activation_bytes, planned_attention, step_temp_bytes
from jaxllm.config.schema import Config
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import abstract_mesh, make_mesh
from jaxllm.model.visibility import gpu_attention
from jaxllm.optim.chain import make_optimizer
from jaxllm.parallel.sharding import bytes_per_device, sharding_tree
from jaxllm.train.step_runner import StepRunner
from jaxllm.objectives.registry import planned_model, planned_step
from jaxllm.train.state import abstract_objective_state, opt_state_specs, state_shardings


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# Memory a GPU shows to CUDA (nvidia-smi's total), by the name the plan prints.
GPUS = {"H100 80 GB": 81559 * 1024**2, "H200 141 GB": 143771 * 1024**2}
# JAX preallocates this share of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
JAX_MEM_FRACTION = 0.75


def memory_plan(cfg: Config, compiled: bool | None = None) -> dict:
    """Parameter counts, and bytes per device of parameters (frozen, trainable), optimizer state and the train
    step's temporaries on `cfg.mesh`, with a verdict per GPU in `GPUS`. Temporaries come from an ahead-of-time
    compile on this machine when `compiled` (None: when the backend is not the CPU and has the mesh's devices),
    else from `jaxllm.plan.activation_memory`'s formula, with the attention a GPU would run. `host_bytes_per_device`
    is what offload keeps in pinned host memory (the optimizer state, offloaded activations); the device total
    and the verdicts leave it out."""
    mesh = abstract_mesh(cfg.mesh)
    state, frozen = abstract_objective_state(planned_model(cfg), make_optimizer(cfg.optim, cfg.train.steps))
    trainable = _count(state.params)
    every = jax.tree.leaves((state.params, frozen))
    plan = dict(
        preset=cfg.model.preset or "custom",
        mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)),
        num_params=trainable + _count(as_float(frozen)),  # a quantised base counts its float kernels
        trainable_params=trainable,
        frozen_bytes_per_device=bytes_per_device(frozen, mesh) if jax.tree.leaves(frozen) else 0,
        param_bytes_per_device=bytes_per_device(state.params, mesh),
        opt_state_values=_count(state.opt_state),
        opt_bytes_per_device=bytes_per_device(state.opt_state, mesh,
                                              opt_state_specs(state.opt_state, mesh, cfg.optim.zero1)),
        opt_on_host=cfg.optim.offload == "host",
        param_bytes_total=sum(math.prod(x.shape) * x.dtype.itemsize for x in every),
    )
    host_activations = host_activation_bytes(cfg, planned_attention(cfg, gpu_attention(cfg.model.attention, cfg.precision.compute)))
    if compiled is None:
        compiled = jax.default_backend() != "cpu" and cfg.mesh.num_devices <= jax.device_count()
    if compiled:
        memory = compiled_step_memory(cfg)
        host_activations = memory["host_temp"]
        plan.update(temp_bytes_per_device=memory["temp"], temp_source=f"compiled on {jax.default_backend()}")
    else:
        attention = planned_attention(cfg, gpu_attention(cfg.model.attention, cfg.precision.compute))
        parts = step_temp_bytes(cfg, attention, plan["param_bytes_per_device"])
        plan.update(temp_bytes_per_device=int(sum(parts.values())), temp_parts={k: int(v) for k, v in parts.items()},
                    temp_source=f"formula, attention {attention} as on a GPU")
    opt_host = plan["opt_bytes_per_device"] if plan["opt_on_host"] else 0
    plan.update(host_bytes_per_device=int(opt_host + host_activations))
    total = sum(plan[k] for k in ("frozen_bytes_per_device", "param_bytes_per_device", "opt_bytes_per_device",
                                  "temp_bytes_per_device")) - opt_host
    plan.update(total_bytes_per_device=total, fits={name: fit_verdict(total, size) for name, size in GPUS.items()})
    return plan


def fit_verdict(total: int, capacity: int) -> str:
    """"fits", "fits with XLA_PYTHON_CLIENT_MEM_FRACTION >= f" or "does not fit", for `total` bytes per device."""
    if total <= JAX_MEM_FRACTION * capacity:
        return "fits"
    if total <= 0.98 * capacity:  # a little stays with CUDA's own context
        return f"fits with XLA_PYTHON_CLIENT_MEM_FRACTION >= {math.ceil(100 * total / capacity) / 100:.2f}"
    return "does not fit"


def compiled_step(cfg: Config):
    """The train step of `cfg` compiled ahead of time for the first `cfg.mesh.num_devices` devices of this
    machine (nothing allocated): its `memory_analysis()` and `as_text()` are what XLA will run."""
    mesh = make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    objective = planned_step(cfg)
    state, frozen = abstract_objective_state(objective, tx, cfg.anomaly.window)
    state = powersgd.with_state(state, powersgd.from_config(cfg.optim), mesh)  # its buffers are step arguments
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, v.dtype) for k, v in synthetic_batch(0, 1, 2, 8).items()}
    runner = StepRunner(objective, tx, cfg, state_shardings(state, mesh, cfg.optim.offload, cfg.optim.zero1),
                        sharding_tree(frozen, mesh), mesh)
    runner.compile(state, batch, frozen)
    return runner.compiled_for(batch)


def compiled_step_memory(cfg: Config) -> dict:
    """Bytes per device of the train step compiled ahead of time for `cfg` (`compiled_step`): `memory_analysis()`'s
    argument, output, alias (donated) and temp (activations, gradients, temporaries) sizes, and the same in host
    memory (`host_argument`, ...: what `optim.offload` and `model.remat_offload` move there)."""
    memory = compiled_step(cfg).memory_analysis()
    kinds = [f"{host}{k}" for host in ("", "host_") for k in ("argument", "output", "alias", "temp")]
    return {k: int(getattr(memory, f"{k}_size_in_bytes")) for k in kinds}


def _size(n: int) -> str:
    return f"{n / 1024**3:.3f} GiB" if n >= 1024**3 / 10 else f"{n / 1024**2:.3f} MiB"


def format_plan(plan: dict) -> str:
    frozen, trainable, opt, temp = (plan[k] for k in ("frozen_bytes_per_device", "param_bytes_per_device",
                                                      "opt_bytes_per_device", "temp_bytes_per_device"))
    on_device = 0 if plan["opt_on_host"] else opt
    offloaded = f" (its {_size(opt)} offloaded)" if plan["opt_on_host"] else ""
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    share = plan["trainable_params"] / plan["num_params"]
    params = (f"frozen parameters {_size(frozen)} + trainable parameters {_size(trainable)}"
              if frozen else f"parameters {_size(trainable)}")
    parts = plan.get("temp_parts")
    temp_detail = " (" + " + ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in parts.items()) + ")" if parts else ""
    lines = [
        f"model {plan['preset']}: {plan['num_params']:,} parameters ({plan['num_params'] / 1e9:.2f} B), "
        f"{plan['trainable_params']:,} trainable ({100 * share:.3g}%)",
        f"mesh {mesh} ({math.prod(plan['mesh'].values())} devices)",
        f"per device: {params} + optimizer state {_size(on_device)}{offloaded} = "
        f"{_size(frozen + trainable + on_device)}",
        f"temporaries per device ({plan['temp_source']}): {_size(temp)}{temp_detail}",
        f"total per device: {_size(plan['total_bytes_per_device'])}",
    ]
    if plan["host_bytes_per_device"]:
        lines.append(f"pinned host memory per device (offload): {_size(plan['host_bytes_per_device'])}")
    lines += [f"{name} ({_size(GPUS[name])}): {verdict}" for name, verdict in plan["fits"].items()]
    return "\n".join(lines)
