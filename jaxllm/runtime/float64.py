"""JAX's 64-bit mode for runs that ask for float64 (`precision.params/compute/output=float64`).

float64 is a reference precision for numerical checks (two layouts of one job reproduce each other over a whole
run: docs/precision-memory.md), not a speed setting. JAX makes float64 arrays only in its 64-bit mode, which must be on
before the first array is made and holds for the whole process, so the scripts switch it on from the config.
"""

from __future__ import annotations

from typing import Any

FLOAT64_KEYS = ("params", "compute", "output")


def wants_float64(precision: Any) -> bool:
    """Whether any of `precision`'s dtypes (a PrecisionConfig or the config's `precision` dict) is float64."""
    return any(getattr(precision, key) == "float64" for key in FLOAT64_KEYS)


def use_float64(precision: Any) -> None:
    """Turn on JAX's 64-bit mode when `precision` asks for float64; call it before anything makes an array."""
    if wants_float64(precision):
        import jax

        jax.config.update("jax_enable_x64", True)
