"""The decoder-only Transformer: embed -> L x (attention + SwiGLU) scanned over stacked layers -> norm -> head.

Parameter names follow Hugging Face Llama (embed_tokens, layers.self_attn.q_proj, layers.mlp.gate_proj,
input_layernorm, post_attention_layernorm, norm, lm_head) so LoRA targets and checkpoint conversion read
naturally. Layer parameters are stacked on a leading `layers` axis and run with `jax.lax.scan`, which keeps
compile time flat in depth.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config.schema import LoRAConfig, ModelConfig, PrecisionConfig
from jaxllm.model.layers import MLP, Attention, Embed, RMSNorm, param
from jaxllm.model.rope import RopeScaling, rope_tables
from jaxllm.model.moe import MoEMLP
from jaxllm.model.visibility import attention_visibility, resolve_attention
from jaxllm.parallel.context import balanced_order, context_shards, from_balanced, to_balanced
from jaxllm.parallel.offload import DEVICE, HOST
from jaxllm.parallel.pipeline import STAGE, num_stages, pipeline
from jaxllm.parallel.sharding import active_mesh, constrain

_QKV = ("query_proj", "key_proj", "value_proj")
# Named intermediates (jaxllm/model/layers.py) each named policy keeps, as MaxText's policies of the same names:
# the projections and the attention context, recomputing the norms, rotations, softmax and SwiGLU product; or only
# the q/k/v projections, recomputing attention and the whole MLP. jaxllm/plan/activation_memory.py counts the same.
REMAT_SAVED_NAMES = {
    "minimal_with_context": _QKV + ("context", "out_proj", "mlp_gate", "mlp_up", "mlp_out"),
    "save_qkv_proj": _QKV,
}
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **{name: jax.checkpoint_policies.save_only_these_names(*saved) for name, saved in REMAT_SAVED_NAMES.items()},
}
# model.remat_offload=host: the same residuals, kept in pinned host memory instead of on the device (none and
# full save nothing to offload; config.validate refuses them).
REMAT_OFFLOAD_POLICIES = {
    "save_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(DEVICE, HOST),
    **{name: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(saved), offload_src=DEVICE, offload_dst=HOST)
       for name, saved in REMAT_SAVED_NAMES.items()},
}


def remat_policy(remat: str, offload: str = "none"):
    """The jax.checkpoint policy of `model.remat`, offloading what it saves to host memory when `offload` is
    "host" (`model.remat_offload`)."""
    return (REMAT_OFFLOAD_POLICIES if offload == "host" else REMAT_POLICIES)[remat]


def residual_seq_axis(sequence_parallel: bool) -> str:
    """The logical name of the residual stream's sequence dimension: `residual_seq` (split over `tensor` by
    jaxllm.parallel.sharding.RULES, Megatron-style sequence parallelism) or the plain, unsplit `seq`."""
    return "residual_seq" if sequence_parallel else "seq"


class DecoderLayer(nnx.Module):
    """One pre-norm decoder block; built with `stack=(L,)` it holds all L layers' parameters.

    `seq_axis` names the sequence dimension of its residual stream (input, output, the norms): see
    `residual_seq_axis`. Attention and the MLP constrain their own activations to the whole sequence.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, stack: tuple = (), rngs: nnx.Rngs, lora=None,
                 seq_axis: str = "seq", quant: str = "none", base_quant: str = "none"):
        self.seq_axis = seq_axis  # static: in the graphdef, not a parameter
        norm = lambda: RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, stack=stack, rngs=rngs,
                               plus_one=cfg.blocks.norm_plus_one)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, stack=stack, rngs=rngs, lora=lora, quant=quant,
                                   base_quant=base_quant)
        self.post_attention_layernorm = norm()
        self.mlp = _feed_forward_block(cfg, dtype, stack, rngs, lora, quant, base_quant)
        # Sandwich norms (Gemma): post_attention_layernorm then normalises attention's output, and these two go
        # around the MLP; without them post_attention_layernorm is the MLP's input norm (Llama).
        self.pre_feedforward_layernorm = norm() if cfg.blocks.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.blocks.sandwich_norms else None

    def __call__(self, x_BTD, visible, sin_BTh, cos_BTh, rng=None, taps: dict | None = None, local=None):
        """The block's output; a `taps` dict (diagnostics, jaxllm/observe/activations.py) receives the
        intermediates attention and the MLP put there; `local` as `Attention`."""
        return self.forward(x_BTD, visible, sin_BTh, cos_BTh, rng, taps, local)[0]

    def forward(self, x_BTD, visible, sin_BTh, cos_BTh, rng=None, taps: dict | None = None, local=None):
        """(the block's output, its router's `jaxllm.model.moe.RouterSums`, or None with a dense MLP)."""
        attn_rng, mlp_rng = (None, None) if rng is None else jax.random.split(rng)
        residual = ("batch", self.seq_axis, "embed")
        attn_BTD = self.self_attn(self.input_layernorm(x_BTD), visible, sin_BTh, cos_BTh, attn_rng, taps, local)
        h_BTD = constrain(x_BTD + self._attention_out(attn_BTD), residual)
        mlp_BTD, router = self._feed_forward(h_BTD, mlp_rng, taps)
        return constrain(h_BTD + mlp_BTD, residual), router

    def _attention_out(self, attn_BTD):
        return attn_BTD if self.pre_feedforward_layernorm is None else self.post_attention_layernorm(attn_BTD)

    def _feed_forward(self, h_BTD, rng=None, taps: dict | None = None, decoding: bool = False):
        """(the feed-forward's output, its router's sums or None); decoding routes dropless."""
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        x_BTD = (self.post_attention_layernorm if pre is None else pre)(h_BTD)
        if isinstance(self.mlp, MoEMLP):
            out_BTD, router = self.mlp(x_BTD, dropless=decoding)
        else:
            out_BTD, router = self.mlp(x_BTD, rng, taps), None
        return (out_BTD if post is None else post(out_BTD)), router

    def decode(self, x_BTD, k_cache_BSKH, v_cache_BSKH, index, mask_BTS, sin_BTh, cos_BTh):
        """The block on T new tokens against one layer's KV cache; returns (out_BTD, k_BSKH, v_BSKH), the cache
        with the new tokens' keys and values written in at slot `index`."""
        attn_BTD, k_BSKH, v_BSKH = self.self_attn.decode(
            self.input_layernorm(x_BTD), k_cache_BSKH, v_cache_BSKH, index, mask_BTS, sin_BTh, cos_BTh)
        # A prefill splits its prompt like training; one new token (T = 1) cannot be split and stays replicated.
        residual = ("batch", self.seq_axis, "embed")
        h_BTD = constrain(x_BTD + self._attention_out(attn_BTD), residual)
        return constrain(h_BTD + self._feed_forward(h_BTD, decoding=True)[0], residual), k_BSKH, v_BSKH


def _feed_forward_block(cfg: ModelConfig, dtype, stack: tuple, rngs: nnx.Rngs, lora, quant: str, base_quant: str):
    """The layer's MLP: dense, or the mixture of experts of `cfg.num_experts` > 0 (no adapters on its experts:
    config.validate refuses them; under QLoRA they stay in float; `quant` applies to them as to a dense MLP)."""
    if not cfg.num_experts:
        return MLP(cfg, dtype=dtype, stack=stack, rngs=rngs, lora=lora, quant=quant, base_quant=base_quant)
    return MoEMLP(cfg.dim, cfg.mlp_dim, cfg.num_experts, cfg.experts_per_token, renormalize=cfg.moe_renormalize,
                  activation=cfg.blocks.activation, init_std=cfg.init_std,
                  out_std=cfg.init_std / (2 * cfg.num_layers) ** 0.5, dtype=dtype, rngs=rngs, stack=stack,
                  dispatch=cfg.moe_dispatch, capacity_factor=cfg.moe_capacity_factor,
                  shared_mlp_dim=cfg.moe_shared_mlp_dim, scores=cfg.moe_router_scores,
                  bias_update_rate=cfg.moe_bias_update_rate, exchange=cfg.moe_exchange, quant=quant)


CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer for S cache slots: two arrays [L, B, S, K, H] for scanned layers, or, with
    the layers unrolled (`model.scan_layers=False`), two tuples of L arrays [B, S, K, H], one per layer, so that
    no decode step slices (copies) a layer's cache out of a stack."""

    k: jax.Array | tuple
    v: jax.Array | tuple

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype) -> "KVCache":
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        if not cfg.scan_layers:
            per_layer = lambda: tuple(constrain(jnp.zeros(shape, dtype), CACHE_AXES[1:]) for _ in range(cfg.num_layers))
            return cls(per_layer(), per_layer())
        stacked = lambda: constrain(jnp.zeros((cfg.num_layers,) + shape, dtype), CACHE_AXES)
        return cls(stacked(), stacked())


def for_layer(local, *inputs):
    """One layer's attention inputs (mask or visibility, sin, cos): with local and global layers (`local`, this
    layer's kind, not None) each input is a (global, local) pair and this picks the layer's; else `inputs`."""
    if local is None:
        return inputs
    return tuple(jax.tree.map(lambda g, l: jnp.where(local, l, g), *pair) for pair in inputs)


def scan_layers_decode(layers: DecoderLayer, x_BTD, cache: KVCache, index, mask_BTS, sin_BTh, cos_BTh,
                       local_L=None):
    """Run stacked `layers` on T new tokens, writing their keys/values into `cache` at slot `index` (mask and
    rotary tables per layer kind with `local_L`, as `for_layer`).

    The whole cache is the scan carry and each layer updates its own [B, T] rows in place with
    dynamic_update_slice, so a decode step copies no more than one layer's cache slice.
    """
    graphdef, stacked = nnx.split(layers)

    def body(carry, xs):
        x, cache_k, cache_v, i = carry
        layer_state, local = xs
        layer = nnx.merge(graphdef, layer_state)
        x, k_BSKH, v_BSKH = layer.decode(x, cache_k[i], cache_v[i], index,
                                         *for_layer(local, mask_BTS, sin_BTh, cos_BTh))
        new = lambda c_BSKH: jax.lax.dynamic_slice_in_dim(c_BSKH, index, x.shape[1], axis=1)[None]
        zero = jnp.zeros_like(index)  # start indices of one integer type (under x64 a literal 0 is int64)
        at = (i.astype(zero.dtype), zero, index, zero, zero)
        cache_k = jax.lax.dynamic_update_slice(cache_k, new(k_BSKH), at)
        cache_v = jax.lax.dynamic_update_slice(cache_v, new(v_BSKH), at)
        return (x, constrain(cache_k, CACHE_AXES), constrain(cache_v, CACHE_AXES), i + 1), None

    (x_BTD, k, v, _), _ = jax.lax.scan(body, (x_BTD, cache.k, cache.v, jnp.int32(0)), (stacked, local_L))
    return x_BTD, KVCache(k, v)


def unroll_layers_decode(layers: tuple, x_BTD, cache: KVCache, index, mask_BTS, sin_BTh, cos_BTh,
                         local_L=None):
    """`scan_layers_decode` as a Python loop over `Transformer.decode_layers`' per-layer modules, on a per-layer
    cache (`model.scan_layers=False`).

    Scanned, every decode step copies each layer's weights that feed cuBLAS (the MLP's three matrices) and its
    cache slice out of the stacks: on an H200 those copies were a third of a 1B model's decode step
    (docs/benchmarks.md). Here the weights were sliced once, ahead of the token loop, and each layer's keys and
    values are arrays of their own.
    """
    keys, values = [], []
    for i, (layer, k_BSKH, v_BSKH) in enumerate(zip(layers, cache.k, cache.v)):
        inputs = (mask_BTS, sin_BTh, cos_BTh)
        if local_L is not None:  # the layer's kind is known here: pick its inputs without a select
            inputs = tuple(pair[int(local_L[i])] for pair in inputs)
        x_BTD, k_BSKH, v_BSKH = layer.decode(x_BTD, k_BSKH, v_BSKH, index, *inputs)
        keys.append(constrain(k_BSKH, CACHE_AXES[1:]))
        values.append(constrain(v_BSKH, CACHE_AXES[1:]))
    return x_BTD, KVCache(tuple(keys), tuple(values))


def layer_keys(rng, num_layers: int):
    """Per-layer key data [L, 2] (uint32) for randomness inside the stacked layers, or None without `rng`.
    Plain arrays stacked like the weights, so `lax.scan` and the pipeline hand each layer its own."""
    return None if rng is None else jax.random.key_data(jax.random.split(rng, num_layers))


def in_compute_dtype(stacked, dtype):
    """The stacked layers' matrices (kernels and adapters, 3 or more dims) cast to the compute `dtype` once, ahead
    of the layer loop; norm scales stay as they are (they are applied in float32).

    Every matmul casts its weight to the compute dtype anyway (`jaxllm.model.lora.project`), so the values are the same;
    cast inside the loop instead, the backward pass casts each kernel a second time and converts each layer's
    gradient on its own (a 6-layer, d256 model in bf16 on 8 CPU devices: 53 MB less read and written per device
    and step, 1.5-3% of the step; docs/benchmarks.md). Under fsdp the loop then gathers the weights in bf16."""
    def cast(a):
        floating = jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype
        return a.astype(dtype) if floating and a.ndim >= 3 else a

    return jax.tree.map(cast, stacked)


def _layer_step(graphdef, visible, sin_BTh, cos_BTh, remat: str, remat_offload: str, prevent_cse: bool,
                probe=None):
    """One layer as a function (x_BTD, (layer_state, key)) -> (x_BTD, stats), rematerialised per `remat` (what it
    saves offloaded to host memory per `remat_offload`). A scan body needs no CSE barrier (the loop already keeps
    XLA from merging the recompute into the forward pass); an unrolled loop does.

    `stats` is the layer's router sums (`jaxllm.model.moe.RouterSums`, per row) with a mixture of experts, None
    with a dense MLP, or with a `probe` (diagnostics: `probe(layer, x_BTD, visible, sin_BTh, cos_BTh, key,
    local) -> (out_BTD, stats)` runs the layer in its place) the probe's per-layer statistics. Without a probe
    the traced program is exactly the plain layer's: the switch is static. With local and global layers the xs
    carry each layer's kind and `visible`, `sin_BTh`, `cos_BTh` are (global, local) pairs (`for_layer`)."""

    def step(x_BTD, xs):
        layer_state, key, local = xs
        layer = nnx.merge(graphdef, layer_state)
        key = None if key is None else jax.random.wrap_key_data(key)
        inputs = for_layer(local, visible, sin_BTh, cos_BTh)
        if probe is not None:
            return probe(layer, x_BTD, *inputs, key, local)
        return layer.forward(x_BTD, *inputs, key, local=local)

    if remat != "none":
        step = jax.checkpoint(step, policy=remat_policy(remat, remat_offload), prevent_cse=prevent_cse)
    return step


def scan_layers(layers: DecoderLayer, x_BTD, visible, sin_BTh, cos_BTh, remat: str = "none", keys_L=None,
                remat_offload: str = "none", probe=None, local_L=None):
    """Run stacked `layers` over `x_BTD` with `lax.scan`, rematerialising each layer per `remat` (what it saves
    offloaded to host memory per `remat_offload`); layer l draws its randomness (LoRA dropout) from `keys_L[l]`
    (None: deterministic). Returns (x_BTD, stats): the layers' statistics stacked [L, ...] as the scan's outputs
    (the `probe`'s, or the routers' sums of a mixture of experts), or None (see `_layer_step`)."""
    graphdef, stacked = nnx.split(layers)
    stacked = in_compute_dtype(stacked, x_BTD.dtype)
    step = _layer_step(graphdef, visible, sin_BTh, cos_BTh, remat, remat_offload, prevent_cse=False, probe=probe)
    with jax.named_scope("layers"):  # profiler traces: the scan's layer index is not static, so one name
        return jax.lax.scan(step, x_BTD, (stacked, keys_L, local_L))


def unroll_layers(layers: DecoderLayer, x_BTD, visible, sin_BTh, cos_BTh, remat: str = "none", keys_L=None,
                  remat_offload: str = "none", probe=None, local_L=None):
    """`scan_layers` as a Python loop (`model.scan_layers=False`): no while loop in the program, so XLA may
    schedule and fuse across layer boundaries, at the price of compile time growing with depth. Layer l's
    parameters are sliced from the same stacked arrays, so the parameter tree, checkpoints, adapters, per-layer
    keys and the remat policy per layer are those of the scan."""
    graphdef, stacked = nnx.split(layers)
    stacked = in_compute_dtype(stacked, x_BTD.dtype)
    step = _layer_step(graphdef, visible, sin_BTh, cos_BTh, remat, remat_offload, prevent_cse=True, probe=probe)
    per_layer = []
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        with jax.named_scope(f"layer_{i}"):  # profiler traces name each unrolled layer
            x_BTD, stats = step(x_BTD, jax.tree.map(lambda a: a[i], (stacked, keys_L, local_L)))
        per_layer.append(stats)
    return x_BTD, None if per_layer[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *per_layer)


def pipeline_layers(layers: DecoderLayer, x_BTD, visible, sin_BTh, cos_BTh, remat: str = "none", *,
                    microbatches: int, repeats: int = 1, debug_nan_bubbles: bool = False, keys_L=None,
                    remat_offload: str = "none", layer_loop=scan_layers, probe=None, local_L=None,
                    seq_split: bool = False):
    """`scan_layers` as a pipeline over the active mesh's `stage` axis (see `jaxllm.parallel.pipeline`): each stage
    runs its own chunks of the stacked layers with `layer_loop` (`scan_layers`, or `unroll_layers` to unroll
    within a chunk); visibility (mask or packed documents) and rotary tables travel with their micro-batch.
    Per-layer keys travel with their layers, so a step's micro-batches share them. Returns (x_BTD, stats) as
    `scan_layers`; a `probe`'s statistics must be per row ([B, ...] leaves) to be put back together from the
    micro-batches (the routers' sums are). `seq_split`: each device of the `context` axis runs its part of the
    sequence inside the pipeline (ring attention; `pipeline(seq_split=True)`), and a probe's statistics are per
    token."""
    graphdef, stacked = nnx.split(layers)
    with_stats = probe is not None or isinstance(layers.mlp, MoEMLP)

    def stage_fn(chunk, x_BTD, aux):
        chunk_state, chunk_keys, chunk_local = chunk
        out = layer_loop(nnx.merge(graphdef, chunk_state), x_BTD, *aux, remat, chunk_keys, remat_offload, probe,
                         chunk_local)
        return out if with_stats else out[0]

    out = pipeline(stage_fn, (stacked, keys_L, local_L), x_BTD, (visible, sin_BTh, cos_BTh), microbatches=microbatches,
                   repeats=repeats, debug_nan_bubbles=debug_nan_bubbles, seq_axis=layers.seq_axis,
                   stage_stats=with_stats, seq_split=seq_split, stats_per_token=probe is not None)
    return out if with_stats else (out, None)


class LayerStackCall(NamedTuple):
    """What a model hands its layer stack besides the activations (`layer_stack_runner`): the per-layer keys and
    kinds ([L, ...] arrays or None), `run_chunk`, its usual layer loop over given layers (the per-token inputs,
    visibility and rotary tables, already bound), and `run_as_usual(x_BTD)`, the model's own run of the whole
    stack (scanned, unrolled or pipelined) -> (x_BTD, stats)."""

    keys_L: jax.Array | None
    local_L: jax.Array | None
    run_chunk: Callable  # (layers, x_BTD, keys_L, local_L) -> (x_BTD, stats): the usual loop over given layers
    run_as_usual: Callable


_LAYER_STACK_RUNNER: contextvars.ContextVar = contextvars.ContextVar("layer_stack_runner", default=None)
_UNROLLED: contextvars.ContextVar = contextvars.ContextVar("layers_unrolled", default=False)


@contextlib.contextmanager
def layers_unrolled():
    """While active (at trace time), every model runs its stacked layers unrolled, as `model.scan_layers=False`
    does: the same parameters and results, no while loop. The diagnostic variant is traced so on XLA:CPU
    (jaxllm/train/diagnostic_step.py says why)."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


@contextlib.contextmanager
def layer_stack_runner(run: Callable):
    """While active (at trace time), every model runs its stacked layers as `run(layers, x_BTD, call)` ->
    (x_BTD, stats), `call` a `LayerStackCall`; embedding before and norm, head and loss after are the model's own.
    The explicit pipeline schedules (jaxllm/train/scheduled_grads.py) split a loss function at its layer stack
    with it: up to the stack, one chunk of the stack, and from the stack on."""
    token = _LAYER_STACK_RUNNER.set(run)
    try:
        yield
    finally:
        _LAYER_STACK_RUNNER.reset(token)


def _rope_scaling(cfg: ModelConfig, given: RopeScaling | None) -> RopeScaling | None:
    """The one rotary scaling of a model: `given` (an imported checkpoint's) or the config's; a config that asks
    for another than the checkpoint carries is refused rather than one of them silently ignored."""
    configured = RopeScaling.from_model_config(cfg)
    if given is not None and configured is not None and given != configured:
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r} (factor {cfg.rope_scaling_factor}) differs from "
                         f"the checkpoint's own RoPE scaling {given}: set model.rope_scaling=none to keep it")
    return given if given is not None else configured


class Transformer(nnx.Module):
    """Llama-style causal language model.

    Call it on int32 token ids [B, T] (optionally with packed-document `segment_ids` and per-document
    `positions`, both [B, T]) to get logits [B, T, V] in the policy's output dtype.
    """

    def __init__(self, cfg: ModelConfig, precision: PrecisionConfig = PrecisionConfig(), *, rngs: nnx.Rngs,
                 rope_scaling: RopeScaling | None = None, pipeline_microbatches: int = 1, pipeline_repeats: int = 1,
                 lora: LoRAConfig | None = None, lm_head: bool = True, sequence_parallel: bool = False,
                 pipeline_schedule: str = "gpipe"):
        dtype = jnp.dtype(precision.params)
        cfg = dataclasses.replace(cfg, attention=resolve_attention(cfg.attention, precision.compute))
        self.cfg = cfg
        # Pipeline schedule (config.PipelineConfig), used only when the active mesh has stage > 1. Plain static
        # attributes, not parameters: they live in the graphdef and leave the parameter tree untouched.
        self.pipeline_microbatches = pipeline_microbatches
        self.pipeline_repeats = pipeline_repeats
        self.pipeline_schedule = pipeline_schedule  # explicit ones are run by the train step (scheduled_grads)
        self.pipeline_debug_nan_bubbles = False  # tests: feed NaN into bubble iterations
        # Megatron-style sequence parallelism (config.MeshConfig.sequence_parallel): the residual stream's
        # sequence splits over `tensor`. Static too: the parameter tree and checkpoints do not change.
        self.sequence_parallel = sequence_parallel
        self.seq_axis = residual_seq_axis(sequence_parallel)
        # Rotary rescaling for a longer context: the config's (model.rope_scaling), or an imported checkpoint's,
        # which may set fields the config cannot spell (Llama 3's bands, YaRN's betas). Static, in the graphdef.
        self.rope_scaling = _rope_scaling(cfg, rope_scaling)
        self.precision = precision
        self.compute_dtype = jnp.dtype(precision.compute)
        self.output_dtype = jnp.dtype(precision.output)
        # Adapters (jaxllm.model.lora) on the stacked projections; None or rank 0: none. Static, in the graphdef.
        self.lora = lora if lora is not None and lora.rank else None
        self.embed_tokens = Embed(cfg.vocab_size, cfg.dim, std=cfg.init_std, dtype=dtype, rngs=rngs,
                                  scaled=cfg.blocks.embed_scale)
        # QLoRA (lora.base_quant): the frozen kernels stored quantised, with adapters or (rank 0: the adapters-off
        # view, `jaxllm.model.lora.adapters_off`) without
        base_quant = lora.base_quant if lora is not None else "none"
        self.layers = DecoderLayer(cfg, dtype=dtype, stack=(cfg.num_layers,), rngs=rngs, lora=self.lora,
                                   seq_axis=self.seq_axis, quant=precision.quant, base_quant=base_quant)
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, rngs=rngs, plus_one=cfg.blocks.norm_plus_one)
        if lm_head and not cfg.tie_embeddings:  # a reward model (jaxllm/model/reward.py) has a score head instead
            self.lm_head = param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"), dtype, cfg.init_std)

    def hidden_states(self, tokens_BT, segment_ids_BT=None, positions_BT=None, rng=None):
        """Final normalised hidden states [B, T, D] in compute dtype; `rng` drives the adapters' dropout (None:
        deterministic, as in evaluation and decoding)."""
        return self._run_layers(tokens_BT, segment_ids_BT, positions_BT, rng)[0]

    def hidden_states_and_router(self, tokens_BT, segment_ids_BT=None, positions_BT=None, rng=None):
        """(`hidden_states`, every layer's router sums [L, B, ...] (`jaxllm.model.moe.RouterSums`) or None for
        a dense model): the training forward of a mixture of experts, whose auxiliary losses come from the sums
        (`jaxllm.model.moe.router_penalty`)."""
        return self._run_layers(tokens_BT, segment_ids_BT, positions_BT, rng)

    def probed_hidden_states(self, tokens_BT, segment_ids_BT, positions_BT, probe):
        """(`hidden_states` without dropout, the statistics `probe` took of every layer, stacked [L, ...]): the
        diagnostic forward of jaxllm/observe/activations.py. `probe(layer, x_BTD, visible, sin_BTh, cos_BTh,
        key, local) -> (out_BTD, stats)` runs each layer in place of its plain call, inside the same layer loop
        (scanned, unrolled or pipelined); stats must be per row ([B, ...] leaves) for the pipeline."""
        return self._run_layers(tokens_BT, segment_ids_BT, positions_BT, None, probe)

    def _run_layers(self, tokens_BT, segment_ids_BT, positions_BT, rng, probe=None):
        """(final normalised hidden states, the probe's per-layer stats or None)."""
        B, T = tokens_BT.shape
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        shards, order_BT, impl = context_shards(), None, self.cfg.attention
        if shards > 1:  # the balanced layout of context parallelism; the head gets the sequence back in order
            tokens_BT, segment_ids_BT, positions_BT = (to_balanced(a, shards)
                                                       for a in (tokens_BT, segment_ids_BT, positions_BT))
            order_BT = jnp.broadcast_to(jnp.asarray(balanced_order(T, shards), jnp.int32), (B, T))
            impl = "ring" if self.cfg.context_attention == "ring" else "xla"
        sin_BTh, cos_BTh = self._rotations(positions_BT)
        windowed = lambda window: attention_visibility(impl, segment_ids_BT, window, order_BT)
        local_L = self._local_layers()
        visible = windowed(self.cfg.sliding_window) if local_L is None else (windowed(0),
                                                                             windowed(self.cfg.sliding_window))
        x_BTD = self.embed_tokens(tokens_BT, self.compute_dtype, self.seq_axis)
        keys_L = layer_keys(rng if self.lora is not None else None, self.cfg.num_layers)
        # The ring's shard_maps inside an explicit schedule's (manual over `stage`): autodiff through a scan over
        # them fails to verify (jax-ml/jax#26588: the nested shard_map's scalar residuals); through an unrolled
        # chunk it does not, so there the chunk's layers are unrolled.
        ring_nested = impl == "ring" and STAGE in active_mesh().manual_axes
        scanned = self.cfg.scan_layers and not ring_nested and not _UNROLLED.get()
        layer_loop = scan_layers if scanned else unroll_layers

        def run_chunk(layers, x_BTD, keys_L, local_L):
            return layer_loop(layers, x_BTD, visible, sin_BTh, cos_BTh, self.cfg.remat, keys_L,
                              self.cfg.remat_offload, probe, local_L)

        def run_as_usual(x_BTD):
            if num_stages() == 1:
                return run_chunk(self.layers, x_BTD, keys_L, local_L)
            return pipeline_layers(self.layers, x_BTD, visible, sin_BTh, cos_BTh, self.cfg.remat,
                                   microbatches=self.pipeline_microbatches, repeats=self.pipeline_repeats,
                                   debug_nan_bubbles=self.pipeline_debug_nan_bubbles, keys_L=keys_L,
                                   remat_offload=self.cfg.remat_offload, layer_loop=layer_loop, probe=probe,
                                   local_L=local_L, seq_split=impl == "ring")

        runner = _LAYER_STACK_RUNNER.get()
        if runner is None:
            x_BTD, stats = run_as_usual(x_BTD)
        else:
            call = LayerStackCall(keys_L, local_L, run_chunk, run_as_usual)
            x_BTD, stats = runner(self.layers, x_BTD, call)
        if shards > 1:
            x_BTD = constrain(from_balanced(x_BTD, shards), ("batch", self.seq_axis, "embed"))
            if probe is not None:  # a probe's statistics are per token [L, B, T]: back in order as well
                in_order = jax.vmap(lambda per_token_BT: from_balanced(per_token_BT, shards))
                stats = jax.tree.map(in_order, stats)
        # The final norm runs on the split sequence too; the head's vocabulary-parallel matmul gathers it (`logits`).
        return self.norm(x_BTD), stats

    def _local_layers(self):
        """Each layer's kind as a bool array [L] (True: local) with local and global layers, else None."""
        local = self.cfg.local_layers()
        return None if local is None else jnp.asarray(local)

    def _rotations(self, positions_BT):
        """Rotary (sin, cos) tables of `positions_BT`; with local and global layers each is a (global, local) pair,
        the local layers' at their own base without the global layers' scaling (Gemma 3)."""
        cfg = self.cfg
        sin_BTh, cos_BTh = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta, self.rope_scaling)
        if cfg.local_layers() is None:
            return sin_BTh, cos_BTh
        local_sin, local_cos = rope_tables(positions_BT, cfg.head_dim, cfg.local_rope_theta or cfg.rope_theta)
        return (sin_BTh, local_sin), (cos_BTh, local_cos)

    def logits(self, x_BTD):
        """Project hidden states to vocabulary logits [B, T, V] in the output dtype."""
        if self.cfg.tie_embeddings:
            logits_BTV = self.embed_tokens.attend(x_BTD)
        else:
            logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, self.lm_head[...].astype(x_BTD.dtype))
        return constrain(logits_BTV.astype(self.output_dtype), ("batch", "seq", "vocab"))

    def __call__(self, tokens_BT, segment_ids_BT=None, positions_BT=None, rng=None):
        return self.logits(self.hidden_states(tokens_BT, segment_ids_BT, positions_BT, rng))

    def decode_layers(self) -> tuple | None:
        """The layers as L modules with arrays of their own (sliced from the stacked weights), for `decode` inside
        a token loop with the layers unrolled; None when they are scanned.

        Call it once, outside the loop: XLA does not hoist slices of a while loop's invariants out of its body, so
        slicing in `decode` would copy every layer's weights at every token. The price is a second copy of the
        layers' weights for the length of the call."""
        if self.cfg.scan_layers:
            return None
        graphdef, stacked = nnx.split(self.layers)
        return tuple(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
                     for i in range(self.cfg.num_layers))

    def decode(self, tokens_BT, cache: KVCache, index, start_B, layers: tuple | None = None, ring: bool = False):
        """KV-cache forward of T new tokens that occupy cache slots [index, index + T).

        Rows are left-padded: row b's first real token sits in slot `start_B[b]`, so its positions count from
        there and slots before it are never attended to. Returns the logits of the last new token [B, V] (the
        only ones sampling needs) and the updated cache. With the layers unrolled, `layers` is
        `decode_layers()`'s result, made once outside the token loop (None: made here).

        With `ring` (one new token: T = 1) the cache is a ring of S slots: `index` and `start_B` count on without
        bound and slot index % S holds the token at `index`, so a row's last S tokens stay visible
        (jaxllm/model/continuous.py).
        """
        T, S = tokens_BT.shape[1], jax.tree.leaves(cache.k)[0].shape[-3]
        if ring and T != 1:
            raise ValueError(f"a ring cache takes one token a step, got {T}")
        slots_T = index + jnp.arange(T, dtype=jnp.int32)
        positions_BT = jnp.maximum(slots_T[None, :] - start_B[:, None], 0)
        sin_BTh, cos_BTh = self._rotations(positions_BT)
        held_S = jnp.arange(S, dtype=jnp.int32)  # the index of the token each slot holds
        if ring:
            held_S, index = index - jnp.mod(index - held_S, S), jnp.mod(index, S)
        slots_11S = held_S[None, None, :]
        mask_BTS = (slots_11S <= slots_T[None, :, None]) & (slots_11S >= start_B[:, None, None])
        local_L = self.cfg.local_layers()
        if self.cfg.sliding_window:  # a row's slots are its positions shifted, so the window counts slots
            windowed_BTS = mask_BTS & (slots_11S > slots_T[None, :, None] - self.cfg.sliding_window)
            mask_BTS = windowed_BTS if local_L is None else (mask_BTS, windowed_BTS)
        x_BTD = self.embed_tokens(tokens_BT, self.compute_dtype, self.seq_axis)
        if self.cfg.scan_layers:
            x_BTD, cache = scan_layers_decode(self.layers, x_BTD, cache, index, mask_BTS, sin_BTh, cos_BTh,
                                              self._local_layers())
        else:
            x_BTD, cache = unroll_layers_decode(layers or self.decode_layers(), x_BTD, cache, index, mask_BTS,
                                                sin_BTh, cos_BTh, local_L)
        return self.logits(self.norm(x_BTD[:, -1:]))[:, 0], cache


def _layer_matmul_params(cfg: ModelConfig, active: bool = False) -> int:
    """The layers' projections; of a mixture of experts all experts, or with `active` those a token runs
    (experts_per_token of them), plus the router and the shared expert with its gate (every token runs them)."""
    D, N, K, H, F = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    experts = (cfg.experts_per_token if active else cfg.num_experts) if cfg.num_experts else 1
    router = D * cfg.num_experts
    shared = (3 * D * cfg.moe_shared_mlp_dim + D) if cfg.moe_shared_mlp_dim else 0
    return cfg.num_layers * (D * N * H * 2 + D * K * H * 2 + experts * 3 * D * F + router + shared)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a token's matmuls (PaLM's N for MFU): all projections plus the output head;
    of a mixture of experts only the experts a token is routed to (the active parameters)."""
    return _layer_matmul_params(cfg, active=True) + cfg.dim * cfg.vocab_size


def total_params(cfg: ModelConfig) -> int:
    """All parameters: embedding table, projections, head (unless tied), norms, and the family's q/k/v biases
    and q/k norms."""
    head = 0 if cfg.tie_embeddings else cfg.dim * cfg.vocab_size
    norms = (2 * cfg.num_layers + 1) * cfg.dim
    blocks, L, H = cfg.blocks, cfg.num_layers, cfg.head_dim
    extras = L * H * ((cfg.num_heads + 2 * cfg.num_kv_heads) * blocks.qkv_bias + 2 * blocks.qk_norm)
    extras += 2 * L * cfg.dim * blocks.sandwich_norms
    return _layer_matmul_params(cfg) + cfg.vocab_size * cfg.dim + head + norms + extras


def train_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """PaLM training FLOPs per token: 6N + 12*L*H*Q*T (attention term halved when `causal`)."""
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * matmul_params(cfg) + (attention / 2 if causal else attention)
