"""Metric writers, throughput and model FLOPs utilisation (MFU).

MFU follows PaLM (DESIGN.md section 7): tokens/s * (6N + 12*L*H*Q*T) / (devices * peak FLOP/s per device).
Peak FLOP/s comes from a table by device kind; on CPU it is measured once with a matmul and cached.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense peak FLOP/s per device (no sparsity), by substring of `device.device_kind`, for bf16/fp16 compute.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is ~756e12
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
}

CPU_PEAK_CACHE = Path(os.environ.get("JAXLLM_CACHE", Path.home() / ".cache" / "jaxllm")) / "cpu_peak_flops.json"


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of a float32 matmul on one CPU device, which uses all host cores (the best XLA CPU gets)."""
    x = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device(override: float = 0.0) -> float:
    """Peak FLOP/s of one local device: the config override, the GPU table, or a cached CPU measurement.

    Fake CPU devices share the host's cores, so the host's measured peak is divided among them.
    """
    if override > 0:
        return override
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        for name, flops in PEAK_FLOPS_BF16.items():
            if name in device.device_kind:
                return flops
        raise ValueError(f"unknown peak FLOP/s for device kind {device.device_kind!r}: set --config.peak_flops")
    key = f"{os.cpu_count()}-cores"
    try:
        cache = json.loads(CPU_PEAK_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_cpu_peak_flops()
        CPU_PEAK_CACHE.parent.mkdir(parents=True, exist_ok=True)
        CPU_PEAK_CACHE.write_text(json.dumps(cache))
    return cache[key] / jax.local_device_count()


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation as a fraction in [0, 1]."""
    return tokens_per_sec * flops_per_token / (num_devices * peak_per_device)


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
