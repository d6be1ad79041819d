"""Blockwise weight quantisation for a frozen base (`lora.base_quant`): NF4 as QLoRA and bitsandbytes define it,
symmetric int8, and the double quantisation of NF4's per-block scales.

NF4 (`nf4_quantize` / `nf4_dequantize`, fixed names): the values are cut into blocks of `block_size` (64) over
the flattened array in row-major order, each block is divided by its absolute maximum ("absmax", float32, one a
block) and each value is replaced by the index of the nearest of the 16 NF4 levels (quantiles of a normal
distribution, exactly 0 and +-1 included); two 4-bit indices share a byte, the first in the high nibble. This is
bitsandbytes' layout (`quantize_4bit(..., quant_type="nf4")`): same levels, same rounding (the value is multiplied
by 1 / absmax in float32 and compared against the midpoints between levels, a value on a midpoint going to the
lower level), same packing; tests/test_qlora.py holds them equal. bitsandbytes is that test's reference only.

Symmetric int8 (`int8_quantize`): round(value / absmax * 127) per block, the same blocks.

Double quantisation (QLoRA's, `quantize_scales`): NF4's absmax values cost 32 bits per 64 weights (0.5 bits a
weight); they are stored instead as 8-bit indices into bitsandbytes' signed "dynamic" code (`dynamic_code`)
after subtracting their mean, with one float32 scale per block of 256 of them: 4.127 bits a weight in all.

The functions here work on arrays whose last axis holds the blocks (`*_blocks`), so the model can keep a
kernel's other axes, and with them its sharding (jaxllm/model/base_quant.py); the flattened, bitsandbytes-shaped
public functions reshape into that form.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

NF4_BLOCK = 64
SCALE_BLOCK = 256  # the block of double quantisation over the absmax values
INT8_MAX = 127.0

# The 16 NF4 levels, bitsandbytes' `get_4bit_type("nf4")` (QLoRA's create_normal_map(offset=0.9677083)).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)


@functools.cache
def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map(signed=True)`): 256 sorted levels in [-1, 1],
    a dynamic exponent (powers of ten) with a fraction that shrinks as the exponent grows. (Its linspace runs
    in float64 here: a few levels may differ from torch's float32 linspace in the last bit.)"""
    levels = []
    for i in range(7):
        boundaries = np.linspace(0.1, 1, 2 ** i + 1)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        levels += list(10.0 ** (i - 6) * means) + list(-(10.0 ** (i - 6)) * means)
    levels += [0.0, 1.0] + [0.0] * (256 - len(levels) - 2)
    return np.sort(np.asarray(levels, np.float32))


def _nearest(scaled, levels: np.ndarray):
    """Index of the nearest of the sorted `levels` for each value; a value on a midpoint takes the lower one
    (torch.bucketize against the midpoints, as bitsandbytes does)."""
    midpoints = jnp.asarray((levels[:-1] + levels[1:]) / np.float32(2))
    return jnp.searchsorted(midpoints, scaled, side="left").astype(jnp.uint8)


def _absmax_scaled(x_blocks):
    """(each block's absmax [..., n], the values scaled into [-1, 1] [..., n, b]) in float32."""
    x = x_blocks.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scaled = jnp.clip(x * (1.0 / jnp.maximum(absmax, 1e-38))[..., None], -1.0, 1.0)
    return absmax, scaled


def nf4_blocks(x_blocks):
    """(packed uint8 [..., n, b/2], absmax float32 [..., n]) of `x_blocks` [..., n, b]: NF4 per last-axis block."""
    absmax, scaled = _absmax_scaled(x_blocks)
    codes = _nearest(scaled, NF4_LEVELS)
    return (codes[..., 0::2] << 4) | codes[..., 1::2], absmax


def nf4_unblocks(packed, absmax, dtype=jnp.float32):
    """The values [..., n, b] of NF4 blocks `packed` [..., n, b/2] with their `absmax` [..., n], in `dtype`."""
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return (jnp.asarray(NF4_LEVELS)[codes] * absmax[..., None]).astype(dtype)


def int8_blocks(x_blocks):
    """(int8 [..., n, b], absmax float32 [..., n]) of `x_blocks` [..., n, b]: symmetric, round to nearest."""
    absmax, scaled = _absmax_scaled(x_blocks)
    return jnp.round(scaled * INT8_MAX).astype(jnp.int8), absmax


def int8_unblocks(codes, absmax, dtype=jnp.float32):
    """The values [..., n, b] of int8 blocks with their `absmax` [..., n], in `dtype`."""
    return (codes.astype(jnp.float32) * (absmax / INT8_MAX)[..., None]).astype(dtype)


def quantize_scales(absmax_blocks, offset):
    """QLoRA's double quantisation of absmax values `absmax_blocks` [..., n, b] (blocks of SCALE_BLOCK) less their
    `offset` (their mean, broadcast against [..., n, b]): (uint8 indices into `dynamic_code()` [..., n, b], float32
    scale [..., n])."""
    scale, scaled = _absmax_scaled(absmax_blocks - offset)
    return _nearest(scaled, dynamic_code()), scale


def dequantize_scales(codes, scale, offset):
    """The absmax values [..., n, b] of `quantize_scales`' (codes, scale) and the `offset` subtracted before."""
    return jnp.asarray(dynamic_code())[codes] * scale[..., None] + offset


def _flat_blocks(w, block_size: int):
    """The flattened `w` in float32, zero-padded to whole blocks, as [blocks, block_size]."""
    flat = jnp.ravel(jnp.asarray(w)).astype(jnp.float32)
    return jnp.pad(flat, (0, -flat.size % block_size)).reshape(-1, block_size)


def nf4_quantize(w, block_size: int = NF4_BLOCK):
    """NF4 of `w` in bitsandbytes' layout: (packed uint8 [ceil(size / 2)], two codes a byte, the first in the high
    nibble; absmax float32 [ceil(size / block_size)]), blocks over the flattened `w` in row-major order (a last,
    shorter block when block_size does not divide the size)."""
    if block_size % 2:
        raise ValueError(f"nf4_quantize: block_size must be even, got {block_size}")
    size = math.prod(jnp.shape(w))
    packed, absmax = nf4_blocks(_flat_blocks(w, block_size))
    return packed.reshape(-1)[:(size + 1) // 2], absmax


def nf4_dequantize(packed, absmax, shape, block_size: int = NF4_BLOCK, dtype=jnp.float32):
    """The array of `shape` that `nf4_quantize(w, block_size)` gave (packed, absmax) for, in `dtype`."""
    size = math.prod(shape)
    packed = jnp.pad(jnp.asarray(packed).reshape(-1), (0, absmax.shape[0] * block_size // 2 - packed.size))
    values = nf4_unblocks(packed.reshape(-1, block_size // 2), jnp.asarray(absmax), dtype)
    return values.reshape(-1)[:size].reshape(shape)


def int8_quantize(w, block_size: int = NF4_BLOCK):
    """Symmetric blockwise int8 of `w`, blocks over the flattened array as `nf4_quantize`'s: (int8 [size],
    absmax float32 [blocks])."""
    codes, absmax = int8_blocks(_flat_blocks(w, block_size))
    return codes.reshape(-1)[:math.prod(jnp.shape(w))], absmax


def int8_dequantize(codes, absmax, shape, block_size: int = NF4_BLOCK, dtype=jnp.float32):
    """The array of `shape` that `int8_quantize(w, block_size)` gave (codes, absmax) for, in `dtype`."""
    size = math.prod(shape)
    codes = jnp.pad(jnp.asarray(codes).reshape(-1), (0, absmax.shape[0] * block_size - codes.size))
    values = int8_unblocks(codes.reshape(-1, block_size), jnp.asarray(absmax), dtype)
    return values.reshape(-1)[:size].reshape(shape)

