"""Host offload through JAX memory kinds: the optimizer state in pinned host memory (`optim.offload=host`) and
the activations a remat policy saves (`model.remat_offload=host`, see jaxllm.model.transformer.remat_policy).

The optimizer state's shardings carry `memory_kind="pinned_host"` (`host_shardings`, applied in the one place
the train state's shardings are made, `jaxllm.train.state.state_shardings`). Everything that places the state
follows those shardings: the jitted initialiser (the state is born in host memory), the step's in/out shardings
and donation, and checkpoint restore. Inside the step `stream_opt_state` copies the state to the device for the
optimizer update and back afterwards; XLA schedules those copies (DMA on a GPU), so between steps the device
holds no optimizer state. Results equal the on-device run bitwise: the same update runs on the same values.

The backend must expose a pinned host memory space (GPUs and TPUs do, and XLA:CPU, where the "transfers" stay in
the same RAM, so the parity tests run in CI); `require_host_memory` turns its absence into a one-line config error.
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxllm.config.schema import Config, ConfigError

HOST = "pinned_host"
DEVICE = "device"


def memory_kinds(device) -> set[str]:
    """The memory spaces `device` can address (e.g. device, pinned_host, unpinned_host)."""
    return {memory.kind for memory in device.addressable_memories()}


def offload_keys(cfg: Config) -> list[str]:
    """The config keys that ask for host offload."""
    asked = (("optim.offload", cfg.optim.offload), ("model.remat_offload", cfg.model.remat_offload))
    return [key for key, value in asked if value == "host"]


def require_host_memory(cfg: Config, devices=None) -> None:
    """Raise a ConfigError naming the offload key when a device (default: this process's) has no pinned host
    memory space; nothing to check when no offload is asked for."""
    keys = offload_keys(cfg)
    if not keys:
        return
    for device in jax.local_devices() if devices is None else devices:
        kinds = memory_kinds(device)
        if HOST not in kinds:
            raise ConfigError(keys[0], f"'host' needs a {HOST!r} memory space, and {device.platform} device "
                                       f"{device.id} has only {sorted(kinds)}")


def host_shardings(shardings):
    """`shardings` (a tree of NamedShardings) placed in pinned host memory, same layout."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def on_host(shardings) -> bool:
    """True when any sharding of the tree `shardings` places its array in pinned host memory."""
    return any(s.memory_kind == HOST for s in jax.tree.leaves(shardings))


def stream_opt_state(step_fn: Callable, state_shardings) -> Callable:
    """`step_fn(state, *rest)` with `state.opt_state` copied from host to device memory before it runs and its
    new optimizer state copied back to host memory after (`state_shardings.opt_state` are host shardings)."""
    host = state_shardings.opt_state
    device = jax.tree.map(lambda s: s.with_memory_kind(DEVICE), host)

    def step(state, *rest):
        state = state.replace(opt_state=jax.device_put(state.opt_state, device))
        new_state, *outputs = step_fn(state, *rest)  # metrics (and the diagnostic variant's statistics)
        return new_state.replace(opt_state=jax.device_put(new_state.opt_state, host)), *outputs

    return step
