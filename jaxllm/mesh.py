"""Build the (data, fsdp, tensor, stage) device mesh.

Axis types are always given explicitly: `jax.make_mesh` defaults to Explicit axes in current JAX while the
rest of jaxllm relies on Auto axes (sharding propagated by XLA, steered by `sharding.constrain`).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.config import MESH_AXES, MeshConfig


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
    if devices is jax.devices() or len(devices) == jax.device_count():
        return jax.make_mesh(cfg.shape, MESH_AXES, axis_types=_auto_axis_types(), devices=devices)
    return jax.sharding.Mesh(np.asarray(devices).reshape(cfg.shape), MESH_AXES, axis_types=_auto_axis_types())


def abstract_mesh(cfg: MeshConfig) -> jax.sharding.AbstractMesh:
    """A device-less mesh of the configured shape, for planning layouts larger than this machine."""
    return jax.sharding.AbstractMesh(cfg.shape, MESH_AXES, axis_types=_auto_axis_types())
