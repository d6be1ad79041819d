"""A frozen base stored quantised (`lora.base_quant` = `int8` | `nf4`): QLoRA's memory saving, native to
jaxllm's stacked kernels.

Each frozen projection kernel (q/k/v/o, gate/up/down) becomes a `QuantizedKernel`: blockwise codes and their
scales (jaxllm/model/blockwise.py), dequantised to the compute dtype inside `jaxllm.model.lora.project` right
before its einsum; the adapters, embeddings, norms and the head stay in float. The blocks run along the kernel's
last input axis (D for q/k/v/gate/up, the head dimension for o_proj, F for down_proj), which is the axis
Hugging Face's [out, in] weights are flattened along: where that axis is a multiple of 64, a kernel's blocks,
levels and packed bytes are those of bitsandbytes' quantize_4bit on the Hugging Face tensor (transposed). A
shorter or odd-sized axis (toy models) takes blocks of gcd(size, 64).

The codes keep every axis of the float kernel (the block axis halved for NF4's two codes a byte), and the scales
every axis but that one shrunk, all with the kernel's logical names: the RULES table shards them as it shards the
float kernel (a dimension the mesh axis does not divide stays replicated, as everywhere).

NF4's absmax values are double-quantised (QLoRA): less each layer's centre (the midrange: see below), as 8-bit
dynamic codes with one float32 scale per block of 256 (gcd(size, 256)) along the kernel's last axis. Storage per
weight: 4 bits + 8 / 64 + 32 / (64 * 256), 4.13 bits (bitsandbytes: 4.127); int8: 8 + 32 / 64 bits.

Why not qwix or flax's quantisation: qwix quantises the matmul's operands on the fly (jaxllm/model/quant.py) and
its NF4 is a weight-only path through model interception, which does not see the stacked kernels inside
`lax.scan`; the kernels here are plain variables that `lax.scan`, the pipeline and the sharding rules carry
like any other.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model import blockwise
from jaxllm.model.quant import weight_einsum


class QuantizedBase(nnx.Variable):
    """A frozen, quantised part of the base (codes and scales): never trained, never decayed."""


def _block(size: int, block: int) -> int:
    return math.gcd(size, block)


def _to_blocks(x, axis: int, block: int):
    """`x` with `axis` moved last and split into [..., size / block, block]."""
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _from_blocks(x_blocks, axis: int):
    """The inverse of `_to_blocks` (the blocks' axis merged back and moved to `axis`)."""
    x = x_blocks.reshape(*x_blocks.shape[:-2], x_blocks.shape[-2] * x_blocks.shape[-1])
    return jnp.moveaxis(x, -1, axis)


class QuantizedKernel(nnx.Module):
    """A frozen kernel of logical axis `names`, quantised blockwise along `block_axis` in `mode` ("int8" or
    "nf4"); `stack` leading axes are layers (one double-quantisation offset each). `dequantize(dtype)` gives the
    kernel back, also for one layer's slice inside `lax.scan` (axes are counted from the end)."""

    def __init__(self, value: jax.Array, names: tuple, block_axis: int, mode: str, stack: int):
        block_axis = block_axis - value.ndim  # from the end: the same axis in one layer's slice
        self.mode, self.block_axis = mode, block_axis  # static
        self.block = _block(value.shape[block_axis], blockwise.NF4_BLOCK)
        blocks = _to_blocks(value, block_axis, self.block)
        quantize = blockwise.nf4_blocks if mode == "nf4" else blockwise.int8_blocks
        codes, absmax = quantize(blocks)
        # what a loader needs to rebuild the float kernel's shape and quantise it again (`float_kernel`)
        about = dict(quant_mode=mode, block_axis=block_axis, stack=stack, kernel_dtype=jnp.dtype(value.dtype).name)
        self.codes = QuantizedBase(_from_blocks(codes, block_axis), out_sharding=names, **about)
        absmax = jnp.moveaxis(absmax, -1, block_axis)  # the kernel's axes, the block axis shrunk
        if mode == "int8":
            self.absmax = QuantizedBase(absmax, out_sharding=names)
            return
        self.scale_block = _block(absmax.shape[-1], blockwise.SCALE_BLOCK)
        # bitsandbytes centres on the mean; a float mean's last bit follows the order of its sum, which follows
        # the layout, so the centre here is the midrange (max and min are exact in any order): the same codes on
        # every mesh, and the smallest largest distance from it
        per_layer = tuple(range(stack, absmax.ndim))
        offset = (jnp.max(absmax, per_layer, keepdims=True) + jnp.min(absmax, per_layer, keepdims=True)) / 2
        scale_codes, scale = blockwise.quantize_scales(_to_blocks(absmax, -1, self.scale_block), offset[..., None])
        self.absmax_codes = QuantizedBase(_from_blocks(scale_codes, -1), out_sharding=names)
        self.absmax_scale = QuantizedBase(scale, out_sharding=names)
        self.absmax_offset = QuantizedBase(offset.reshape(offset.shape[:stack]), out_sharding=names[:stack])

    def _arrays(self) -> tuple:
        """The stored arrays: codes, then the absmax (int8) or its codes, scales and offsets (nf4)."""
        if self.mode == "int8":
            return self.codes[...], self.absmax[...]
        return self.codes[...], self.absmax_codes[...], self.absmax_scale[...], self.absmax_offset[...]

    def _absmax(self, arrays: tuple) -> jax.Array:
        """Each block's absmax, float32, laid out as the kernel with the block axis shrunk."""
        if self.mode == "int8":
            return arrays[1]
        _, scale_codes, scale, offset = arrays
        offset = offset.reshape(offset.shape + (1,) * (scale_codes.ndim - offset.ndim))
        codes = _to_blocks(scale_codes, -1, self.scale_block)
        return _from_blocks(blockwise.dequantize_scales(codes, scale, offset[..., None]), -1)

    def _dequantize(self, arrays: tuple, dtype) -> jax.Array:
        absmax = jnp.moveaxis(self._absmax(arrays), self.block_axis, -1)
        codes = _to_blocks(arrays[0], self.block_axis, self.block // 2 if self.mode == "nf4" else self.block)
        unblock = blockwise.nf4_unblocks if self.mode == "nf4" else blockwise.int8_unblocks
        return _from_blocks(unblock(codes, absmax, dtype), self.block_axis)

    def dequantize(self, dtype) -> jax.Array:
        """The kernel in `dtype` (scales applied in float32, then cast)."""
        return self._dequantize(self._arrays(), dtype)

    def einsum(self, spec: str, x: jax.Array, quant: str = "none") -> jax.Array:
        """`weight_einsum(spec, x, kernel, quant)` with the kernel dequantised to `x`'s dtype under
        `jax.checkpoint`: the backward pass dequantises it again rather than keeping each layer's float kernel
        from the forward pass, which would hold a float copy of the base through the step (what QLoRA saves)."""
        def run(x, arrays):
            return weight_einsum(spec, x, self._dequantize(arrays, x.dtype), quant)

        return jax.checkpoint(run)(x, self._arrays())


def frozen_kernel(value: jax.Array, names: tuple, n_in: int, stack: int, mode: str):
    """`value` (a kernel whose first `stack` axes are layers, then `n_in` input axes) as the frozen kernel
    `mode` asks for: a QuantizedKernel, or ("none") the plain parameter."""
    if mode == "none":
        return nnx.Param(value, out_sharding=tuple(names))
    if mode == "nf4" and _block(value.shape[stack + n_in - 1], blockwise.NF4_BLOCK) % 2:
        raise ValueError(f"base_quant=nf4: a kernel's input axis of odd size {value.shape[stack + n_in - 1]} "
                         "cannot pack two codes a byte")
    return QuantizedKernel(value, tuple(names), stack + n_in - 1, mode, stack)


def kernel_einsum(spec: str, x: jax.Array, kernel, quant: str = "none") -> jax.Array:
    """`weight_einsum(spec, x, kernel, quant)` of a projection's kernel in `x`'s dtype, whether stored plain
    (nnx.Param) or quantised."""
    if isinstance(kernel, QuantizedKernel):
        return kernel.einsum(spec, x, quant)
    return weight_einsum(spec, x, kernel[...].astype(x.dtype), quant)


def dequantized(model: nnx.Module, state: nnx.State, dtype) -> nnx.State:
    """`state` (the non-adapter state of `model`, keyed as `model`) with each QuantizedKernel's codes and scales
    replaced by its kernel dequantised to `dtype`, as a plain nnx.Param: the float base of a QLoRA model."""
    flat = dict(nnx.to_flat_state(state))
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedKernel):
            names = node.codes.get_metadata()["out_sharding"]
            flat = {key: v for key, v in flat.items() if key[:len(path)] != tuple(path)}
            with nnx.use_eager_sharding(False):  # placement is jaxllm.parallel.sharding's
                flat[tuple(path)] = nnx.Param(node.dequantize(dtype), out_sharding=names)
    return nnx.from_flat_state(list(flat.items()))


def float_kernel(codes: nnx.Variable) -> nnx.Param:
    """The abstract float kernel (a ShapeDtypeStruct in an nnx.Param, with the kernel's logical names) whose
    quantised codes `codes` (abstract or not) are."""
    meta = codes.get_metadata()
    shape = list(codes.shape)
    if meta["quant_mode"] == "nf4":
        shape[meta["block_axis"]] *= 2
    with nnx.use_eager_sharding(False):
        return nnx.Param(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(meta["kernel_dtype"])),
                         out_sharding=meta["out_sharding"])


def quantized_kernels(state: nnx.State) -> dict[tuple, nnx.Variable]:
    """{path of a QuantizedKernel in `state`: its codes variable}."""
    return {path[:-1]: v for path, v in nnx.to_flat_state(state)
            if isinstance(v, QuantizedBase) and path[-1] == "codes"}


def as_float(state: nnx.State) -> nnx.State:
    """`state` (abstract or not) with each quantised kernel's codes and scales replaced by its abstract float
    kernel: what the base holds, to read it or count its parameters."""
    kernels = quantized_kernels(state)
    inside = lambda path: any(path[:len(k)] == k for k in kernels)
    rest = [(p, v) for p, v in nnx.to_flat_state(state) if not inside(p)]
    return nnx.from_flat_state(rest + [(k, float_kernel(c)) for k, c in kernels.items()])


def quantize_kernel(value: jax.Array, codes: nnx.Variable) -> nnx.State:
    """The state of the QuantizedKernel whose codes variable is `codes`, made from its float kernel `value`."""
    meta = codes.get_metadata()
    with nnx.use_eager_sharding(False):
        return nnx.state(QuantizedKernel(value, meta["out_sharding"], meta["block_axis"] + value.ndim,
                                         meta["quant_mode"], meta["stack"]))
