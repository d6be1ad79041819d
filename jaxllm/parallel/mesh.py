"""Build the (data, fsdp, expert, tensor, stage) device mesh.

Axis types are always given explicitly: `jax.make_mesh` defaults to Explicit axes in current JAX while the
rest of jaxllm relies on Auto axes (sharding propagated by XLA, steered by `sharding.constrain`).

Across processes the mesh is hybrid: each axis is `dcn` host groups (outer) times the devices inside a host
(inner), as `jax.experimental.mesh_utils.create_hybrid_device_mesh` lays out, so only the axes given a dcn size
above 1 (by default `data`) send traffic between hosts.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxllm.config.schema import MESH_AXES, Config, MeshConfig
from jax.experimental import mesh_utils


def _auto_axis_types() -> tuple:
    return (jax.sharding.AxisType.Auto,) * len(MESH_AXES)


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all) with axes named `MESH_AXES`, in Auto mode.

    The device order puts the last axes (tensor, stage... in `MESH_AXES` order) on neighbouring devices, which on
    GPUs keeps tensor parallelism inside a host.
    """
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) != cfg.num_devices:
        raise ValueError(f"mesh {cfg.shape} needs {cfg.num_devices} devices, got {len(devices)}")
    processes = len({d.process_index for d in devices})
    if processes > 1:
        if math.prod(cfg.dcn_shape) != processes:
            raise ValueError(f"mesh dcn sizes {cfg.dcn_shape} do not multiply to the {processes} processes "
                             "(resolve them with jaxllm.config.schema.resolve_dcn)")

        grid = mesh_utils.create_hybrid_device_mesh(cfg.host_shape, cfg.dcn_shape, devices, process_is_granule=True,
                                                    allow_split_physical_axes=True)
        return jax.sharding.Mesh(grid, MESH_AXES, axis_types=_auto_axis_types())
    if devices is jax.devices() or len(devices) == jax.device_count():
        return jax.make_mesh(cfg.shape, MESH_AXES, axis_types=_auto_axis_types(), devices=devices)
    return jax.sharding.Mesh(np.asarray(devices).reshape(cfg.shape), MESH_AXES, axis_types=_auto_axis_types())


def run_mesh(cfg: Config) -> jax.sharding.Mesh:
    """The mesh a run trains on: every device, less those an RL run sets aside for its rollouts
    (`rollout_mesh`)."""
    aside = cfg.rl.set_aside(cfg.train.objective)
    return make_mesh(cfg.mesh, _split_devices(aside)[0] if aside else None)


def rollout_mesh(cfg: Config) -> jax.sharding.Mesh | None:
    """The mesh of an RL run's own rollout devices (rl.placement=disaggregated): rl.rollout_devices devices, the
    last ones of every process alike, splitting rows only (`data`: every device holds the whole policy and
    decodes without collectives); None when the rollouts share the run's mesh."""
    aside = cfg.rl.set_aside(cfg.train.objective)
    if not aside:
        return None
    return make_mesh(MeshConfig(data=aside, dcn_data=jax.process_count()), _split_devices(aside)[1])


def _split_devices(aside: int) -> tuple[list, list]:
    """(the trainer's devices, the rollouts' `aside`): each process gives its last aside / processes devices to
    the rollouts, so that both meshes span every process and each process samples the rows it trains on (its
    block of either mesh's batch)."""
    per_process = aside // jax.process_count()
    trainer, rollout = [], []
    for p in range(jax.process_count()):
        own = [d for d in jax.devices() if d.process_index == p]
        trainer += own[:len(own) - per_process]
        rollout += own[len(own) - per_process:]
    return trainer, rollout


def abstract_mesh(cfg: MeshConfig) -> jax.sharding.AbstractMesh:
    """A device-less mesh of the configured shape, for planning layouts larger than this machine."""
    return jax.sharding.AbstractMesh(cfg.shape, MESH_AXES, axis_types=_auto_axis_types())


def single_device_mesh() -> jax.sharding.Mesh:
    """A mesh of the first device alone (every axis 1): scripts that load one model to use it."""
    return make_mesh(MeshConfig(), devices=jax.devices()[:1])
