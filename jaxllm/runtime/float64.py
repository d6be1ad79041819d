"""JAX's 64-bit mode for runs that ask for float64 (`precision.params/compute/output=float64`).

float64 is a reference precision for numerical checks (whether two layouts of a job, or a change to the code,
differ by more than rounding: docs/precision-memory.md), not a speed setting. JAX makes float64 arrays only in its
64-bit mode, which must be on before the first array is made and holds for the whole process, so the scripts
switch it on from the config.
"""

from __future__ import annotations

from typing import Any


def use_float64(precision: Any) -> None:
    """Turn on JAX's 64-bit mode when any dtype of `precision` (a PrecisionConfig or the config's `precision`
    dict) is float64; call it before anything makes an array."""
    if any(getattr(precision, key) == "float64" for key in ("params", "compute", "output")):
        import jax

        jax.config.update("jax_enable_x64", True)
