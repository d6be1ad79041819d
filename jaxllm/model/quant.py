"""Quantised training matmuls (`precision.quant`): the transformer blocks' weight einsums through qwix's
quantised dot, in int8 or fp8.

With `precision.quant=int8` the q/k/v/o projections and the three SwiGLU projections run as int8 x int8 -> int32
dots in the forward pass and in both backward dots (the gradients with respect to activations and to weights),
quantised on the fly with absmax scales per channel: in the forward pass activations per token and weights per
output channel; in the backward pass the incoming gradient per token (activation gradient) or per output channel
(weight gradient), against the forward pass's int8 operands, whose scales qwix moves onto the gradient before
quantising it. Parameters, optimizer state and everything else stay in their dtypes; attention's score and value
products (q.k, p.v), the norms, LoRA adapters, the embedding lookup and the output head (logits) stay in the
compute dtype. A mixture of experts' expert projections run their grouped matmuls quantised the same way
(`expert_ragged_dot`, scales per expert), its shared expert as a dense MLP; its router stays in the compute dtype.

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

import jax
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


def expert_ragged_dot(x_PD, kernel_EDF, group_sizes_E, quant: str = "none", row_axes: tuple[str, ...] = ()):
    """`jax.lax.ragged_dot(x, kernel, group_sizes)` for a mixture's expert matmul (the rows grouped by expert,
    `group_sizes_E` of them each; rows past the groups give zeros), quantised as `quant` says, in the types of
    `weight_einsum`'s dots, forward and backward.

    Scales: the rows per row; the kernel per expert and output channel; the gradients per row (input gradient)
    and per expert and channel (weight gradient), the latter's absmax over every row of the (micro-)batch:
    inside the expert layer's shard_map a device holds only some rows, and the max is also taken over
    `row_axes`, the mesh axes the others are on, as the dense path's global view does. So an expert's numbers
    do not depend on how rows and experts are laid out over devices (the tensor split of the down projection's
    inputs aside: its scales are per shard).

    Written here rather than taken from qwix (whose dense dot `weight_einsum` uses): qwix's quantised ragged dot
    scales the kernel per output channel across all the device's experts (so by which experts share a device),
    takes the weight gradient's scales over the device's rows only, and rounds to qwix's integer bound (see
    `_quantise`)."""
    kernel_EDF = kernel_EDF.astype(x_PD.dtype)
    if quant == "none":
        return jax.lax.ragged_dot(x_PD, kernel_EDF, group_sizes_E)
    # Inside a shard_map both operands vary over the axes either varies over before they enter the custom rule,
    # whose cotangents keep their primals' types: the casts' own transposes add the gradients up over the axes
    # they were cast over (the kernel's over the rows' axes, the rows' over `tensor` where it splits the kernel).
    x_PD, kernel_EDF = _varying_alike(x_PD, kernel_EDF)
    return _ragged_dot_qt(x_PD, kernel_EDF, group_sizes_E, quant, row_axes)


def _varying_alike(*arrays):
    """`arrays`, each cast to vary over every manual mesh axis any of them varies over."""
    varying = lambda a: jax.typeof(a).manual_axis_type.varying
    axes = frozenset().union(*map(varying, arrays))
    return tuple(jax.lax.pcast(a, tuple(sorted(axes - varying(a))), to="varying") if axes - varying(a) else a
                 for a in arrays)


def _largest(qtype) -> float:
    return float(jnp.iinfo(qtype).max if jnp.issubdtype(qtype, jnp.integer) else jnp.finfo(qtype).max)


def _scale(absmax, qtype):
    """The scale that maps `absmax` to `qtype`'s largest value (1 where absmax is 0)."""
    return jnp.where(absmax > 0, absmax / _largest(qtype), 1.0)


def _quantise(a, qtype, absmax):
    """(`a` in `qtype` at the scale of `absmax`, broadcast to `a`; that scale, float32).

    Each maximum maps to the type's largest value: not to qwix's integer bound (127.5 for int8), which puts it on
    a rounding tie. And `a` is multiplied by the inverse scale rather than divided by the scale: XLA:CPU divides
    by a broadcast value as a multiplication by its reciprocal in some fusions and not in others, so the same
    numbers quantised inside a shard_map and outside rounded to different levels."""
    inverse = jnp.where(absmax > 0, _largest(qtype) / absmax, 1.0)
    scaled = a.astype(jnp.float32) * inverse
    if jnp.issubdtype(qtype, jnp.integer):
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -_largest(qtype), _largest(qtype)).astype(qtype), _scale(absmax, qtype)


def _absmax(a, axis: int):
    return jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axis, keepdims=True)


def _accumulator(qtype):
    return jnp.int32 if jnp.issubdtype(qtype, jnp.integer) else jnp.float32


def _ragged_dot_qt_fwd(x_PD, kernel_EDF, group_sizes_E, quant, row_axes):
    types = QTYPES[quant]
    qx_PD, sx_P1 = _quantise(x_PD, types["lhs_qtype"], _absmax(x_PD, 1))
    qk_EDF, sk_E1F = _quantise(kernel_EDF, types["rhs_qtype"], _absmax(kernel_EDF, 1))
    expert_P = _expert_of_rows(group_sizes_E, x_PD.shape[0])
    out_PF = jax.lax.ragged_dot(qx_PD, qk_EDF, group_sizes_E, preferred_element_type=_accumulator(types["lhs_qtype"]))
    out_PF = out_PF.astype(jnp.float32) * sx_P1 * _per_row(sk_E1F[:, 0], expert_P)
    return out_PF.astype(x_PD.dtype), (qx_PD, sx_P1, qk_EDF, sk_E1F, group_sizes_E, expert_P)


def _expert_of_rows(group_sizes_E, rows: int):
    """[rows]: the expert of each grouped row, E past the groups."""
    E = group_sizes_E.shape[0]
    expert_P = jnp.repeat(jnp.arange(E), group_sizes_E, total_repeat_length=rows)
    return jnp.where(jnp.arange(rows) < jnp.sum(group_sizes_E), expert_P, E)


def _per_row(per_expert_EF, expert_P):
    """[rows, F]: each grouped row's expert's entry (`expert_P` from `_expert_of_rows`; past the groups: zeros)."""
    return jnp.concatenate([per_expert_EF, jnp.zeros_like(per_expert_EF[:1])])[expert_P]


def _ragged_dot_qt_bwd(quant, row_axes, residuals, g_PF):
    types = QTYPES[quant]
    qx_PD, sx_P1, qk_EDF, sk_E1F, group_sizes_E, expert_P = residuals
    E, g_dtype = qk_EDF.shape[0], g_PF.dtype
    # Input gradient: g times each row's expert's kernel transposed, the kernel's scales moved onto g first.
    g_PF = g_PF.astype(jnp.float32)
    g_dx_PF = g_PF * _per_row(sk_E1F[:, 0], expert_P)
    qg_PF, sg_P1 = _quantise(g_dx_PF, types["dlhs_grad_qtype"], _absmax(g_dx_PF, 1))
    dx_PD = jax.lax.ragged_dot(qg_PF, jnp.swapaxes(qk_EDF, 1, 2), group_sizes_E,
                               preferred_element_type=_accumulator(types["dlhs_grad_qtype"]))
    dx_PD = dx_PD.astype(jnp.float32) * sg_P1
    # Weight gradient: each expert's rows of x (quantised in the forward pass) against its rows of g, the rows'
    # scales moved onto g, which is quantised per expert and output channel.
    gw_PF = g_PF * sx_P1
    absmax_EF = jax.ops.segment_max(jnp.abs(gw_PF), expert_P, num_segments=E)  # rows past the groups: dropped
    absmax_EF = jnp.maximum(absmax_EF, 0.0)  # an expert without rows: -inf
    if row_axes:
        absmax_EF = jax.lax.pmax(absmax_EF, row_axes)
    absmax_PF = _per_row(absmax_EF, expert_P)
    qgw_PF, _ = _quantise(gw_PF, types["drhs_grad_qtype"], absmax_PF)
    rows_contracted = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dk_EDF = jax.lax.ragged_dot_general(qx_PD, qgw_PF, group_sizes_E, rows_contracted,
                                        preferred_element_type=_accumulator(types["drhs_grad_qtype"]))
    dk_EDF = dk_EDF.astype(jnp.float32) * _scale(absmax_EF, types["drhs_grad_qtype"])[:, None, :]
    # The kernel came in the rows' dtype (`expert_ragged_dot`), the dtype of g.
    return dx_PD.astype(g_dtype), dk_EDF.astype(g_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_dot_qt(x_PD, kernel_EDF, group_sizes_E, quant, row_axes):
    return _ragged_dot_qt_fwd(x_PD, kernel_EDF, group_sizes_E, quant, row_axes)[0]


_ragged_dot_qt.defvjp(_ragged_dot_qt_fwd, _ragged_dot_qt_bwd)
