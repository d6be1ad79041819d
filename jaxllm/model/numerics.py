"""The precision of the model's sensitive arithmetic: softmaxes, norms, rotations, the router and the loss.

A bfloat16 or float16 run widens these to float32 (as transformers does); a float64 run (`precision.*=float64`,
a reference precision for numerical checks) must keep float64 there, or every such step rounds its activations to
float32 and two layouts of one job part at float32's last bit again.
"""

import jax
import jax.numpy as jnp


def widened(x: jax.Array) -> jax.Array:
    """`x` in float32, or as it is when its dtype is wider (float64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
