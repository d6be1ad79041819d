"""Quantised training matmuls (`precision.quant`): the transformer blocks' weight einsums through qwix's
quantised dot, in int8 or fp8.

With `precision.quant=int8` the q/k/v/o projections and the three SwiGLU projections run as int8 x int8 -> int32
dots in the forward pass and in both backward dots (the gradients with respect to activations and to weights),
quantised on the fly with absmax scales per channel: in the forward pass activations per token and weights per
output channel; in the backward pass the incoming gradient per token (activation gradient) or per output channel
(weight gradient), against the forward pass's int8 operands, whose scales qwix moves onto the gradient before
quantising it. Parameters, optimizer state and everything else stay in their dtypes; attention's score and value
products (q.k, p.v), the norms, LoRA adapters, the embedding lookup and the output head (logits) stay in the
compute dtype.

Why the head stays out: its backward dots take the softmax gradient p - onehot(target), whose per-token range is
set by the target's -1, so an int8 absmax scale (~1/127) rounds every other vocabulary entry's p (~1/V) to zero.
Measured on the default job's model after 40 float32 AdamW steps: the head's weight gradient was 86% off
float32's (relative L2), and through the hidden states every other gradient 4-60% off; with the head in float32
no gradient was more than 1.6% off (scripts/bench_quant.py measures what that does to the held-out loss).

qwix is the kept library that does the quantisation (no hand-written kernels here). Its public interception API
(`qwix.QtProvider` / `quantize_model`) rewrites calls it can see in a model, which misses our raw einsums on
stacked kernels inside `lax.scan`, so we call its core quantised dot directly as einsum's `_dot_general`
(a private qwix module: tests/test_private_imports.py checks it stays where we expect).

With `precision.quant=fp8` the same matmuls run through qwix's dot with float8 types instead: e4m3 operands in
the forward pass, e5m2 gradients in the backward dots, the same per-channel absmax scales computed from the
current tensors ("current scaling": no amax history in the train state, unlike delayed scaling, at the cost of
one reduction per operand). On Hopper-class GPUs XLA can run float8 dots as cuBLASLt fp8 GEMMs (its step time
is a GPU measurement: scripts/bench_step.py with precision.quant=fp8). On a CPU XLA widens them to float32 dots,
which keeps fp8's rounding but none of its speed, so config.validate accepts fp8 on a CPU only with
`debug.emulate_fp8` (for convergence checks: scripts/bench_quant.py).

"none" (the default) uses plain `jnp.einsum`, so the default job's program is unchanged.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


# The operand and gradient types of each mode. fp8 follows the usual recipe (Transformer Engine's "hybrid"
# format): e4m3 (more mantissa) for activations and weights, e5m2 (more range) for the gradients.
QTYPES = {
    "int8": dict(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8),
    "fp8": dict(lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
                dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2),
}


@functools.cache
def _quantised_dot_general(quant: str):
    """A `lax.dot_general`-shaped function computing in `quant`'s types forward and backward (qwix)."""
    from qwix._src.core import dot_general_qt

    cfg = dot_general_qt.DotGeneralQtConfig(**QTYPES[quant])

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        # precision / preferred_element_type do not apply: qwix accumulates in int32 (int8) or float32 (fp8) and
        # rescales to the operands' dtype, which einsum's callers (compute dtype in, compute dtype out) expect.
        return dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, cfg)

    return dot_general


def weight_einsum(spec: str, x, kernel, quant: str = "none"):
    """`jnp.einsum(spec, x, kernel)` for a weight matmul, quantised as `quant` says ("none": exactly einsum)."""
    if quant == "none":
        return jnp.einsum(spec, x, kernel)
    return jnp.einsum(spec, x, kernel, _dot_general=_quantised_dot_general(quant))
