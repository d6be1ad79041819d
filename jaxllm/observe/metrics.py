"""Metric writers, throughput and model FLOPs utilisation (MFU).

MFU follows PaLM (DESIGN.md section 7): tokens/s * (6N + 12*L*H*Q*T) / (devices * peak FLOP/s per device).
Peak FLOP/s comes from a table by device kind; on CPU it is measured once with a matmul and cached.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

# Dense peak FLOP/s per device (no sparsity), by substring of `device.device_kind`: (bf16/fp16, float32). On these
# GPUs JAX's default float32 matmul precision runs on TF32 tensor cores, so float32 compute is measured against the
# dense TF32 peak (V100 has no TF32: its plain FP32 peak); a run that sets jax_default_matmul_precision="highest"
# computes true float32 and should pass --config.peak_flops. The first match wins: "H100 PCIe" before "H100".
PEAK_FLOPS = {
    "H200": (989e12, 494.7e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494.7e12),  # SXM
    "A100": (312e12, 156e12),
    "A10G": (125e12, 62.5e12),
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),
}

_warned_kinds: set[str] = set()

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


def peak_flops_per_device(override: float = 0.0, compute_dtype: str = "bfloat16", device=None) -> float:
    """Peak FLOP/s of one local device (`device`, default the first) computing in `compute_dtype`: the config
    override, the GPU table, or a cached CPU measurement.

    An accelerator the table does not know (a new GPU, a TPU) gives NaN, so MFU reads NaN, with one warning per
    device kind: a throughput figure must never stop a run. Fake CPU devices share the host's cores, so the
    host's measured peak is divided among them.
    """
    if override > 0:
        return override
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        return _table_peak(device.device_kind, compute_dtype)
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


def _table_peak(kind: str, compute_dtype: str) -> float:
    """The PEAK_FLOPS entry of device kind `kind` for `compute_dtype` (float32: TF32), NaN with a one-time
    warning when the kind is unknown."""
    for name, (half, single) in PEAK_FLOPS.items():
        if name in kind:
            return single if compute_dtype == "float32" else half
    if kind not in _warned_kinds:
        _warned_kinds.add(kind)
        warnings.warn(f"no peak FLOP/s known for device kind {kind!r}: MFU is reported as NaN (set "
                      "--config.peak_flops to the device's dense peak to get it)", RuntimeWarning, stacklevel=3)
    return float("nan")


def mfu(tokens_per_sec: float, flops_per_token: float, num_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation as a fraction in [0, 1]."""
    return tokens_per_sec * flops_per_token / (num_devices * peak_per_device)


def scalar_fields(record: dict) -> dict[str, float]:
    """The numeric fields of `record` other than `step` (bools and strings are not scalars to plot)."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written. The file
    is opened at the first record: a run that stops before writing one leaves no file behind."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
