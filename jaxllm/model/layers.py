"""Building blocks of the Llama-style decoder: embedding, RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Dimension letters (shape suffixes and einsum strings):
  B batch   T query positions   S key/value positions   D model width (embed)
  N query heads   K kv heads   G query heads per kv head (N = K*G)   H head dim
  F MLP hidden   V vocabulary   L stacked layers

Parameters carry logical axis names in `out_sharding` metadata; `jaxllm.parallel.sharding.RULES` maps them to mesh
axes. Blocks that are stacked over layers take `stack=(L,)`: their parameters get a leading `layers` dimension
and their `__call__` sees one layer's slice (inside `lax.scan`).

Intermediates that a remat policy may keep carry `checkpoint_name`s (see REMAT_POLICIES in
jaxllm/model/transformer.py): query_proj, key_proj, value_proj (after the rotation), context (the attention
output before o_proj), out_proj, mlp_gate, mlp_up, mlp_out. Outside `jax.checkpoint` the names do nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxllm.model.base_quant import frozen_kernel
from jaxllm.model.lora import adapter, project
from jaxllm.model.numerics import widened
from jaxllm.model.cudnn_attention import cudnn_attention
from jaxllm.model.rope import apply_rope
from jaxllm.parallel.context import DocumentOrder, context_shards, ring_attention
from jaxllm.parallel.sharding import constrain

# Masked attention scores use a large finite negative: -inf would turn fully masked rows (padding) into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def param(rngs: nnx.Rngs, shape, names, dtype, std: float | None) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (or ones when std is None) with logical axis `names`."""
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(names))


def kernel(rngs: nnx.Rngs, shape, names, dtype, std: float, *, n_in: int, stack: tuple, base_quant: str):
    """A projection kernel drawn as `param` draws it (its first `len(stack)` axes layers, then `n_in` input
    axes), stored as `base_quant` says: plain, or quantised for a frozen base (jaxllm/model/base_quant.py)."""
    value = param(rngs, shape, names, dtype, std)
    return value if base_quant == "none" else frozen_kernel(value[...], names, n_in, len(stack), base_quant)


class Embed(nnx.Module):
    """Token embedding table [V, D]; also the output projection when embeddings are tied. With `scaled`
    (Gemma's blocks.embed_scale) looked-up embeddings are multiplied by sqrt(D); the output projection is not."""

    def __init__(self, vocab_size: int, dim: int, *, std: float, dtype, rngs: nnx.Rngs, scaled: bool = False):
        self.embedding = param(rngs, (vocab_size, dim), ("vocab", "embed"), dtype, std)
        self.scale = dim**0.5 if scaled else None  # static

    def __call__(self, tokens_BT: jax.Array, dtype, seq_axis: str = "seq") -> jax.Array:
        """Embeddings [B, T, D] of `tokens_BT` laid out as the residual stream whose sequence axis is the logical
        `seq_axis` (`residual_seq` under sequence parallelism)."""
        # Gather from the table laid out as in compute (vocab over `tensor`, embed whole): XLA then looks up
        # locally and sums over `tensor`, instead of replicating the whole table ("involuntary remat"). With the
        # sequence split over `tensor` that sum becomes a reduce-scatter.
        table_VD = constrain(self.embedding[...], ("vocab", "embed"))
        x_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(dtype)
        if self.scale is not None:
            x_BTD = x_BTD * jnp.asarray(self.scale, dtype)
        return constrain(x_BTD, ("batch", seq_axis, "embed"))

    def attend(self, x_BTD: jax.Array) -> jax.Array:
        return jnp.einsum("BTD,VD->BTV", x_BTD, self.embedding[...].astype(x_BTD.dtype))


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 whatever the compute dtype. `plus_one` (Gemma's
    blocks.norm_plus_one): it scales by (1 + w) with w starting at zero, else by w starting at one."""

    def __init__(self, dim: int, *, eps: float, dtype, stack: tuple = (), rngs: nnx.Rngs, plus_one: bool = False):
        self.scale = param(rngs, stack + (dim,), ("layers",) * len(stack) + ("norm",), dtype,
                           0.0 if plus_one else None)
        self.eps = eps
        self.plus_one = plus_one  # static

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = widened(x)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x32.dtype)
        return (x32 * (scale + 1.0 if self.plus_one else scale)).astype(x.dtype)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, scale: float | None = None):
    """Grouped-query attention in plain einsums (softmax in float32); `mask_BTS` says who may see whom; scores
    scale by `scale` (None: head_dim ** -0.5)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scale = H**-0.5 if scale is None else scale
    scores_BKGTS = widened(jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH)) * scale
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, MASK_VALUE)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


def windowed_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, window: int, scale: float | None = None):
    """`xla_attention` for a sliding `window` that divides T: queries in blocks of `window`, each against its own
    block's keys and the block's before (all a window can reach), so 2 * T * window scores instead of T * T. The
    dense `mask_BTS` still says who sees whom (documents, the window itself); the result is the same."""
    B, T, N, H = q_BTNH.shape
    K, W = k_BSKH.shape[2], window
    blocks = T // W
    scale = H**-0.5 if scale is None else scale

    def two_blocks(x_BSKH):  # [B, blocks, 2W, K, H]: the block before (zeros before the first) and its own
        padded = jnp.pad(x_BSKH, ((0, 0), (W, 0), (0, 0), (0, 0))).reshape(B, blocks + 1, W, K, H)
        return jnp.concatenate([padded[:, :-1], padded[:, 1:]], axis=2)

    q_BnWKGH = q_BTNH.reshape(B, blocks, W, K, N // K, H)
    columns_nC = jnp.arange(blocks)[:, None] * W + jnp.arange(2 * W)[None, :]  # in the mask padded by W in front
    padded_BTS = jnp.pad(mask_BTS, ((0, 0), (0, 0), (W, 0))).reshape(B, blocks, W, T + W)
    mask_BnWC = jnp.take_along_axis(padded_BTS, columns_nC[None, :, None, :], axis=3)
    scores = widened(jnp.einsum("BnWKGH,BnCKH->BnKGWC", q_BnWKGH, two_blocks(k_BSKH))) * scale
    scores = jnp.where(mask_BnWC[:, :, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKH.dtype)
    out_BnWKGH = jnp.einsum("BnKGWC,BnCKH->BnWKGH", probs, two_blocks(v_BSKH))
    return out_BnWKGH.reshape(B, T, N, H)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions (q_proj, k_proj, v_proj, o_proj), each projection with
    an optional LoRA adapter (`lora`: a `jaxllm.model.lora.LoRAConfig`). The family's blocks (`cfg.blocks`) may
    add biases to q, k and v (q_bias, k_bias, v_bias), an RMSNorm over each head of q and k before the rotation
    (q_norm, k_norm), and a sliding window (`cfg.sliding_window` positions, the mask's; static)."""

    def __init__(self, cfg, *, dtype, stack: tuple = (), rngs: nnx.Rngs, lora=None, quant: str = "none",
                 base_quant: str = "none"):
        D, N, K, H = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lead = ("layers",) * len(stack)
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        # the frozen base's kernels stored quantised under QLoRA (lora.base_quant)
        frozen = dict(stack=stack, base_quant=base_quant)
        self.q_proj = kernel(rngs, stack + (D, N, H), lead + ("embed", "heads", "head_dim"), dtype, std, n_in=1,
                             **frozen)
        self.k_proj = kernel(rngs, stack + (D, K, H), lead + ("embed", "kv_heads", "head_dim"), dtype, std, n_in=1,
                             **frozen)
        self.v_proj = kernel(rngs, stack + (D, K, H), lead + ("embed", "kv_heads", "head_dim"), dtype, std, n_in=1,
                             **frozen)
        self.o_proj = kernel(rngs, stack + (N, H, D), lead + ("heads", "head_dim", "embed"), dtype, out_std, n_in=2,
                             **frozen)
        kw = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.q_proj_lora = adapter(lora, "q_proj", (D,), (N, H), ("embed",), ("heads", "head_dim"), **kw)
        self.k_proj_lora = adapter(lora, "k_proj", (D,), (K, H), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.v_proj_lora = adapter(lora, "v_proj", (D,), (K, H), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.o_proj_lora = adapter(lora, "o_proj", (N, H), (D,), ("heads", "head_dim"), ("embed",), **kw)
        blocks, zero = cfg.blocks, 0.0  # biases start at zero (std 0)
        bias = lambda heads, axis: param(rngs, stack + (heads, H), lead + (axis, "head_dim"), dtype, zero)
        self.q_bias = bias(N, "heads") if blocks.qkv_bias else None
        self.k_bias = bias(K, "kv_heads") if blocks.qkv_bias else None
        self.v_bias = bias(K, "kv_heads") if blocks.qkv_bias else None
        head_norm = lambda: RMSNorm(H, eps=cfg.norm_eps, dtype=dtype, stack=stack, rngs=rngs,
                                    plus_one=blocks.norm_plus_one)
        self.q_norm = head_norm() if blocks.qk_norm else None
        self.k_norm = head_norm() if blocks.qk_norm else None
        self.window = cfg.sliding_window
        self.scale = (cfg.query_pre_attn_scalar or H) ** -0.5  # static
        self.impl = cfg.attention
        self.quant = quant  # precision.quant of the projections (static; q.k and p.v stay unquantised)

    def _project(self, x_BTD, sin_BTh, cos_BTh, rng=None):
        """Rotated queries [B, T, N, H] and rotated keys / values [B, T, K, H] of `x_BTD`."""
        q_BTNH = project("BTD,DNH->BTNH", x_BTD, self.q_proj, self.q_proj_lora, _fold(rng, 0),
                         quant=self.quant)
        k_BSKH = project("BSD,DKH->BSKH", x_BTD, self.k_proj, self.k_proj_lora, _fold(rng, 1),
                         quant=self.quant)
        v_BSKH = project("BSD,DKH->BSKH", x_BTD, self.v_proj, self.v_proj_lora, _fold(rng, 2),
                         quant=self.quant)
        q_BTNH = _per_head(q_BTNH, self.q_bias, self.q_norm)
        k_BSKH = _per_head(k_BSKH, self.k_bias, self.k_norm)
        v_BSKH = _per_head(v_BSKH, self.v_bias, None)
        q_BTNH = constrain(apply_rope(q_BTNH, sin_BTh, cos_BTh), ("batch", "seq", "heads", "head_dim"))
        k_BSKH = constrain(apply_rope(k_BSKH, sin_BTh, cos_BTh), ("batch", "seq", "kv_heads", "head_dim"))
        v_BSKH = constrain(v_BSKH, ("batch", "seq", "kv_heads", "head_dim"))
        return (checkpoint_name(q_BTNH, "query_proj"), checkpoint_name(k_BSKH, "key_proj"),
                checkpoint_name(v_BSKH, "value_proj"))

    def __call__(self, x_BTD, visible, sin_BTh, cos_BTh, rng=None, taps: dict | None = None, local=None):
        """Self-attention of `x_BTD`; `visible` comes from `attention_visibility(self.impl, segment_ids)`; `rng`
        drives the adapters' dropout (None: none). A `taps` dict (diagnostics) receives the rotated queries and
        keys as "q" and "k". `local` (a traced bool, with local and global layers) says whether this layer is
        windowed: masks carry it already, cuDNN's kernel takes it as its window."""
        q_BTNH, k_BSKH, v_BSKH = self._project(x_BTD, sin_BTh, cos_BTh, rng)
        if taps is not None:
            taps.update(q=q_BTNH, k=k_BSKH)
        T = q_BTNH.shape[1]
        if isinstance(visible, DocumentOrder):  # a sequence split over `context`, attended around the ring
            out_BTNH = ring_attention(q_BTNH, k_BSKH, v_BSKH, visible, self.scale)
        elif context_shards() > 1:  # the split sequence's queries against all keys and values, gathered
            whole = ("batch", None, "kv_heads", "head_dim")
            out_BTNH = xla_attention(q_BTNH, constrain(k_BSKH, whole), constrain(v_BSKH, whole), visible, self.scale)
        elif self.impl == "xla" and local is None and self.window and T % self.window == 0 and T > self.window:
            out_BTNH = windowed_attention(q_BTNH, k_BSKH, v_BSKH, visible, self.window, self.scale)
        elif self.impl == "xla":
            out_BTNH = xla_attention(q_BTNH, k_BSKH, v_BSKH, visible, self.scale)
        elif self.impl == "cudnn":
            kernel = lambda window: cudnn_attention(q_BTNH, k_BSKH, v_BSKH, visible, window, self.scale)
            out_BTNH = kernel(self.window) if local is None else jax.lax.cond(
                local, lambda: kernel(self.window), lambda: kernel(0))
        else:  # jax.nn's XLA implementation (it handles grouped-query heads itself)
            out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=visible[:, None], scale=self.scale)
        out_BTNH = checkpoint_name(constrain(out_BTNH, ("batch", "seq", "heads", "head_dim")), "context")
        out_BTD = project("BTNH,NHD->BTD", out_BTNH, self.o_proj, self.o_proj_lora, _fold(rng, 3),
                          quant=self.quant)
        return checkpoint_name(out_BTD, "out_proj")

    def decode(self, x_BTD, k_cache_BSKH, v_cache_BSKH, index, mask_BTS, sin_BTh, cos_BTh):
        """Attend from T new tokens to a KV cache of S slots (the new tokens' keys written at slot `index`).

        `mask_BTS` says which cache slots each new token may see. Returns the attention output [B, T, D] and
        the cache with the new tokens' keys and values written in ([B, S, K, H] each): the caller keeps these as
        its cache, so a step writes each layer's new slots once (in place) instead of copying the cache again.
        """
        dtype = x_BTD.dtype
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, sin_BTh, cos_BTh)
        k_BTKH, v_BTKH = k_BTKH.astype(k_cache_BSKH.dtype), v_BTKH.astype(v_cache_BSKH.dtype)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_cache_BSKH, k_BTKH, index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_cache_BSKH, v_BTKH, index, axis=1)
        # Always the XLA path: T is 1 per step, where fused kernels bring nothing and cuDNN needs T == S.
        out_BTNH = xla_attention(q_BTNH, k_BSKH.astype(dtype), v_BSKH.astype(dtype), mask_BTS, self.scale)
        out_BTNH = constrain(out_BTNH, ("batch", "seq", "heads", "head_dim"))
        out_BTD = project("BTNH,NHD->BTD", out_BTNH, self.o_proj, self.o_proj_lora, quant=self.quant)
        return out_BTD, k_BSKH, v_BSKH


# The MLP's gate activations (blocks.activation): SwiGLU's, and GeGLU's with the tanh approximation (Hugging Face's
# gelu_pytorch_tanh).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)) with the family's activation (SwiGLU, GeGLU), each
    projection with an optional LoRA adapter."""

    def __init__(self, cfg, *, dtype, stack: tuple = (), rngs: nnx.Rngs, lora=None, quant: str = "none",
                 base_quant: str = "none"):
        D, F = cfg.dim, cfg.mlp_dim
        lead = ("layers",) * len(stack)
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
        frozen = dict(n_in=1, stack=stack, base_quant=base_quant)  # QLoRA's quantised base
        self.gate_proj = kernel(rngs, stack + (D, F), lead + ("embed", "mlp"), dtype, std, **frozen)
        self.up_proj = kernel(rngs, stack + (D, F), lead + ("embed", "mlp"), dtype, std, **frozen)
        self.down_proj = kernel(rngs, stack + (F, D), lead + ("mlp", "embed"), dtype, out_std, **frozen)
        kw = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj_lora = adapter(lora, "gate_proj", (D,), (F,), ("embed",), ("mlp",), **kw)
        self.up_proj_lora = adapter(lora, "up_proj", (D,), (F,), ("embed",), ("mlp",), **kw)
        self.down_proj_lora = adapter(lora, "down_proj", (F,), (D,), ("mlp",), ("embed",), **kw)
        self.quant = quant  # precision.quant of the three projections (static)
        self.activation = cfg.blocks.activation  # static

    def __call__(self, x_BTD, rng=None, taps: dict | None = None):
        """The feed-forward of `x_BTD`; a `taps` dict (diagnostics) receives the gate's pre-activations as "gate"."""
        # One line per projection naming its parameter: the communication report attributes collectives by it.
        gate = lambda spec, x: project(spec, x, self.gate_proj, self.gate_proj_lora, _fold(rng, 4), quant=self.quant)
        up = lambda spec, x: project(spec, x, self.up_proj, self.up_proj_lora, _fold(rng, 5), quant=self.quant)
        down = lambda spec, x: project(spec, x, self.down_proj, self.down_proj_lora, _fold(rng, 6), quant=self.quant)
        return checkpoint_name(gated_mlp(x_BTD, self.activation, gate, up, down, taps), "mlp_out")


def gated_mlp(x_BTD, activation: str, gate, up, down, taps: dict | None = None):
    """down(act(gate(x)) * up(x)), the gated feed-forward of a dense MLP and of a mixture's shared expert; `gate`,
    `up` and `down` are `(einsum spec, x) -> projection`; `taps` (diagnostics) receives the gate's
    pre-activations as "gate"."""
    gate_BTF = gate("BTD,DF->BTF", x_BTD)
    if taps is not None:
        taps["gate"] = gate_BTF
    gate_BTF = checkpoint_name(gate_BTF, "mlp_gate")
    up_BTF = checkpoint_name(up("BTD,DF->BTF", x_BTD), "mlp_up")
    h_BTF = constrain(ACTIVATIONS[activation](gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
    return down("BTF,FD->BTD", h_BTF)


def _per_head(x_BTNH, bias, norm):
    """Projected heads plus their bias and through their norm, where the family has them (None: not)."""
    if bias is not None:
        x_BTNH = x_BTNH + bias[...].astype(x_BTNH.dtype)
    return x_BTNH if norm is None else norm(x_BTNH)


def _fold(rng, i: int):
    """The key of adapter `i` of a layer (None stays None: no dropout)."""
    return None if rng is None else jax.random.fold_in(rng, i)
