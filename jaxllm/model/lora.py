"""LoRA adapters native to jaxllm's stacked, scanned einsum kernels, with PEFT's math.

A target kernel W maps input axes to output axes, e.g. q_proj [L, D, N, H]: D -> (N, H). Its adapter is
A [L, D, r] and B [L, r, N, H] (o_proj's input is (N, H): A [L, N, H, r], B [L, r, D]), and the projection becomes

    y = W x + scale * B(A(dropout(x))),   scale = alpha / r   (alpha / sqrt(r) with rsLoRA)

A starts from PEFT's kaiming-uniform draw (bound 1/sqrt(fan_in)) and B at zero, so a fresh adapter leaves the
model's outputs exactly as they were. Adapters are ordinary variables of the layer modules, stacked on the same
leading `layers` axis, so `lax.scan` and the pipeline carry them with their kernels, and the RULES table places
them by their logical names (A's input axes like the kernel's, B's heads / mlp over `tensor`, the rank axis
`lora_rank` replicated). Libraries that inject adapters by intercepting calls do not see stacked kernels under a
raw `lax.scan`; this is why the adapters are written here by hand.
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config.schema import LoRAConfig
from jaxllm.model.base_quant import dequantized, kernel_einsum
from jaxllm.parallel.sharding import constrain, permutes_hang

# Each target's adapter is the attribute `<target>_lora` of its module (jaxllm/model/layers.py), so this suffix
# marks adapter arrays in a checkpoint's names too.
ADAPTER_SUFFIX = "_lora"
MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRA(nnx.Module):
    """The adapter of one stacked kernel: `delta(x)` is scale * B(A(dropout(x)))."""

    def __init__(self, in_shape: tuple, out_shape: tuple, in_names: tuple, out_names: tuple, cfg: LoRAConfig, *,
                 stack: tuple, dtype, rngs: nnx.Rngs):
        lead = ("layers",) * len(stack)
        bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform_(a=sqrt(5)) on A [r, fan_in]
        a = jax.random.uniform(rngs.params(), stack + in_shape + (cfg.rank,), jnp.float32, -bound, bound)
        self.a = nnx.LoRAParam(a.astype(dtype), out_sharding=lead + in_names + ("lora_rank",))
        self.b = nnx.LoRAParam(jnp.zeros(stack + (cfg.rank,) + out_shape, dtype),
                               out_sharding=lead + ("lora_rank",) + out_names)
        self.scale = cfg.scale
        self.dropout = cfg.dropout
        self.n_in, self.n_out = len(in_shape), len(out_shape)
        self.in_names, self.out_names = tuple(in_names), tuple(out_names)

    def __call__(self, x, rng=None):
        """The adapter's contribution for input `x` [B, T, *in] (dropout only when `rng` is given)."""
        if rng is not None and self.dropout > 0:
            keep = jax.random.bernoulli(rng, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        ins, outs = string.ascii_lowercase[:self.n_in], string.ascii_lowercase[self.n_in:self.n_in + self.n_out]
        a = self._in_compute(self.a[...], self.in_names + ("lora_rank",))
        h = jnp.einsum(f"BT{ins},{ins}r->BTr", x, a.astype(x.dtype))
        return self.scale * jnp.einsum(f"BTr,r{outs}->BT{outs}", h,
                                       self._in_compute(self.b[...], ("lora_rank",) + self.out_names).astype(x.dtype))

    @staticmethod
    def _in_compute(weight, names):
        """An adapter matrix, in its compute layout where collective permutes would hang (`permutes_hang`:
        XLA:CPU inside an explicit pipeline schedule's per-stage branch): left to itself there, XLA's partitioner
        moved A's fsdp split over to `tensor` with a collective permute under fsdp x tensor. Elsewhere as XLA
        lays it out (constrained everywhere, a DPO run under fsdp x tensor wedged in an XLA:CPU all-reduce)."""
        if not permutes_hang():
            return weight
        return constrain(weight, (None,) * (weight.ndim - len(names)) + names)

    def delta_weight(self) -> jax.Array:
        """scale * A @ B in float32, shaped like the kernel (the merge of PEFT's merge_and_unload).

        The rank is summed one term at a time, in order, rather than by a matmul: a matmul's summation order
        follows how the kernel is split over the mesh, and a merged model is a base whose fingerprint must be
        the same on every mesh (jaxllm/runs/base_model.py).
        """
        lead = string.ascii_uppercase[:self.a.ndim - self.n_in - 1]
        ins, outs = string.ascii_lowercase[:self.n_in], string.ascii_lowercase[self.n_in:self.n_in + self.n_out]
        a = jnp.moveaxis(self.a[...].astype(jnp.float32), -1, 0)  # [r, *lead, *in]
        b = jnp.moveaxis(self.b[...].astype(jnp.float32), len(lead), 0)  # [r, *lead, *out]
        outer = lambda a_i, b_i: jnp.einsum(f"{lead}{ins},{lead}{outs}->{lead}{ins}{outs}", a_i, b_i)

        def add_term(total, ab):
            return total + outer(*ab), None

        total, _ = jax.lax.scan(add_term, jnp.zeros(jax.eval_shape(outer, a[0], b[0]).shape, jnp.float32), (a, b))
        return self.scale * total


def adapter(cfg: LoRAConfig | None, target: str, in_shape, out_shape, in_names, out_names, *, stack, dtype,
            rngs) -> LoRA | None:
    """The adapter of `target` when `cfg` asks for one, else None."""
    if cfg is None or not cfg.rank or target not in cfg.target_list:
        return None
    return LoRA(tuple(in_shape), tuple(out_shape), tuple(in_names), tuple(out_names), cfg, stack=stack, dtype=dtype,
                rngs=rngs)


def project(spec: str, x, kernel, lora: LoRA | None, rng=None, quant: str = "none"):
    """`einsum(spec, x, kernel)` plus the adapter's contribution when there is one (the one place model code
    applies LoRA: training, evaluation and KV-cache decoding all go through it). `quant` (`precision.quant`)
    quantises the kernel's matmul only, never the adapter's (jaxllm/model/quant.py)."""
    y = kernel_einsum(spec, x, kernel, quant)
    return y if lora is None else y + lora(x, rng).astype(y.dtype)


def adapters_off(cfg: LoRAConfig | None) -> LoRAConfig | None:
    """The `lora` argument of the adapters-off view of a model built with `cfg` (the frozen reference of DPO, PPO
    and GRPO): None, the plain model, unless its base is stored quantised (`lora.base_quant`), which the view keeps
    (rank 0: no adapters)."""
    if cfg is None or cfg.base_quant == "none":
        return None
    return dataclasses.replace(cfg, rank=0)


def trainable(cfg: LoRAConfig | None):
    """The nnx filter of what trains: the adapters, or every parameter when there are none (rank 0: full
    fine-tuning)."""
    return nnx.LoRAParam if cfg is not None and cfg.rank else nnx.Param


def adapters_of(model) -> dict[str, LoRA]:
    """{target: its stacked adapter} of a Transformer."""
    targets = model.lora.target_list if model.lora is not None else ()
    return {t: getattr(getattr(model.layers, MODULE_OF[t]), f"{t}{ADAPTER_SUFFIX}") for t in targets}


def merge(model):
    """The plain model of the same class (no adapters) with each target kernel W + scale * A @ B, computed in
    float32 and stored in the kernel's dtype, as PEFT's merge_and_unload does. A model without adapters is returned
    as it is. A quantised base (`lora.base_quant`) is dequantised to the parameter dtype first: the merge is a float
    model."""
    if model.lora is None:
        return model

    def plain():
        with nnx.use_eager_sharding(False):
            return nnx.split(type(model)(model.cfg, model.precision, rngs=nnx.Rngs(0),
                                         rope_scaling=model.rope_scaling,
                                         pipeline_microbatches=model.pipeline_microbatches,
                                         pipeline_repeats=model.pipeline_repeats,
                                         sequence_parallel=model.sequence_parallel,
                                         pipeline_schedule=model.pipeline_schedule))[0]

    # New Variables around the same arrays: the merged model must not share (and so rewrite) `model`'s.
    base = jax.tree.map(lambda x: x, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    base = dequantized(model, base, jnp.dtype(model.precision.params))
    merged = nnx.merge(jax.eval_shape(plain), base)
    for target, lora in adapters_of(model).items():
        kernel = getattr(getattr(merged.layers, MODULE_OF[target]), target)
        kernel[...] = (kernel[...].astype(jnp.float32) + lora.delta_weight()).astype(kernel.dtype)
    return merged
