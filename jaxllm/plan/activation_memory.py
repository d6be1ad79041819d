"""Temporary bytes per device of the train step by formula: what `memory_analysis()` calls temp (saved
activations, gradients, the output head's logits, one layer's backward working set), for meshes and machines
that are not here.

Every term counts one device's share: rows split over data x fsdp, heads / MLP / vocabulary over tensor,
layers over stage, the sequence over context. What a layer keeps for its backward pass follows `model.remat` (the names are
jaxllm/model/layers.py's checkpoint names); with `model.remat_offload=host` the named residuals live in host
memory instead (`host_activation_bytes`), and the device keeps each layer's input only. The einsum attention
(`xla`, `dot_product`) keeps its [T, S] scores in float32; cuDNN's fused kernel keeps only per-row softmax
statistics. Over `mesh.context` (jaxllm/parallel/context.py) the all-gather attention keeps its queries' [T / N, T]
scores; the ring ("ring") holds one [T / N, T / N] block's at a time and keeps none (its backward pass recomputes
them). `scripts/bench_memory.py --tables planner` prints this formula against compiled `memory_analysis()`
figures.

With `mesh.sequence_parallel` the residual-stream-shaped [tokens, D] intermediates a layer keeps for its
backward pass (its input, the o_proj and down_proj outputs, the norms and the residual sum) are split over
`tensor` too. One layer's backward working set is counted whole: it works on the all-gathered sequence. On the
default job's shape at T 1024 over tensor=4 this lands at +6% (remat none) and +26% (remat full) of the compiled
figures (bench_memory's planner table; +3% without sequence parallelism).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.config.schema import Config
from jaxllm.model.transformer import REMAT_SAVED_NAMES

FLOAT32 = 4


def _layer_terms(cfg: Config, rows: int, attention: str, residual_split: int = 1) -> dict[str, float]:
    """Bytes of each intermediate of one layer on one device, by checkpoint name (and the unnamed rest), with
    the [tokens, D] ones split `residual_split` ways along the sequence."""
    m, mesh, T = cfg.model, cfg.mesh, cfg.train.seq_len
    c = jnp.dtype(cfg.precision.compute).itemsize
    queries = T / mesh.context  # this device's positions of the sequence
    n = rows * queries  # tokens on this device
    residual = n * m.dim * c / residual_split
    heads, kv, mlp = m.num_heads / mesh.tensor, m.num_kv_heads / mesh.tensor, m.mlp_dim / mesh.tensor
    # A mixture of experts runs its MLP on (token, expert) pairs: k a token. Dropless dispatch over an expert
    # group of `mesh.expert` devices holds the whole group's pairs on each device (zero outside its own experts'
    # groups: jaxllm/parallel/experts.py); capacity dispatch its experts' buffers, factor x k a token in all.
    # Plus each pair's gathered input and weighted output, the group's gathered rows, and the router's float32
    # logits, probabilities and log-probabilities.
    # A shared expert (model.moe_shared_mlp_dim) is a dense MLP beside them: every token, its hidden units over
    # tensor, its gate and up under the same names.
    pairs, dispatch, shared = n, 0.0, n * m.moe_shared_mlp_dim / mesh.tensor * c
    if m.num_experts:
        spread = m.moe_capacity_factor if m.moe_dispatch == "capacity" else mesh.expert
        pairs = n * m.experts_per_token * spread
        dispatch = 2 * pairs * m.dim * c + (mesh.expert - 1) * residual + 3 * n * m.num_experts * FLOAT32
    if attention == "cudnn":
        scores = rows * heads * T * FLOAT32  # softmax statistics only
    elif attention == "ring":
        scores = rows * heads * queries * queries * (FLOAT32 + c)  # one block's, while it is folded in
    else:
        scores = rows * heads * queries * T * (FLOAT32 + c)  # float32 scores and the probabilities
    return {
        "input": residual,  # the layer's input: the scan keeps it whatever the policy
        "query_proj": n * heads * m.head_dim * c, "key_proj": n * kv * m.head_dim * c,
        "value_proj": n * kv * m.head_dim * c,
        "context": n * heads * m.head_dim * c, "out_proj": residual,
        "mlp_gate": pairs * mlp * c + shared, "mlp_up": pairs * mlp * c + shared, "mlp_out": residual,
        # scores; two norms and a residual; sigmoid(gate), silu(gate) and their product with up; experts' dispatch
        "unnamed": scores + 3 * residual + 3 * (pairs * mlp * c + shared) + dispatch,
    }


_SAVED = {
    "none": None,  # everything
    "full": ("input",),
    # every matmul without batch dimensions: the projections, not attention's own einsums
    "save_dots": ("input", "query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_out"),
    **{name: ("input",) + saved for name, saved in REMAT_SAVED_NAMES.items()},
}


def _softmax_backward(cfg: Config, rows: float, attention: str) -> float:
    """Bytes of the einsum attention's softmax backward working set beyond its forward's: the gradients of the
    probabilities and of the scores, float32, one [T, S] pair per head. Without it the formula kept a third of
    what a compiled llama_1b step at T = 8k-32k holds (docs/benchmarks.md, long context)."""
    if attention == "cudnn":
        return 0.0
    T, heads = cfg.train.seq_len, cfg.model.num_heads / cfg.mesh.tensor
    queries = T / cfg.mesh.context
    keys = queries if attention == "ring" else T
    return 2 * rows * heads * queries * keys * FLOAT32


def _rows(cfg: Config) -> float:
    """Rows of one micro-batch on one device."""
    return cfg.train.batch_size / cfg.mesh.batch_shards / cfg.optim.grad_accum


def _residual_split(cfg: Config) -> int:
    """How many ways the residual stream's sequence is split (`mesh.sequence_parallel`: over tensor)."""
    return cfg.mesh.tensor if cfg.mesh.sequence_parallel else 1


def planned_attention(cfg: Config, gpu_attention: str) -> str:
    """The attention the target runs: over `mesh.context` the ring or the all-gather's einsum path, else
    `gpu_attention` (`jaxllm.model.visibility.gpu_attention` of the config)."""
    if cfg.mesh.context > 1:
        return "ring" if cfg.model.context_attention == "ring" else "xla"
    return gpu_attention


def host_activation_bytes(cfg: Config, attention: str) -> float:
    """Bytes per device of saved activations in host memory (`model.remat_offload=host`: every residual the
    policy saves but the layer inputs, which the layer scan keeps on the device); 0 without offload."""
    m = cfg.model
    if m.remat_offload != "host" or _SAVED[m.remat] is None:
        return 0.0
    terms = _layer_terms(cfg, _rows(cfg), attention, _residual_split(cfg))
    return sum(terms[k] for k in _SAVED[m.remat] if k != "input") * m.num_layers / cfg.mesh.stage


def step_temp_bytes(cfg: Config, attention: str, trainable_bytes: int) -> dict[str, float]:
    """Estimated temp bytes per device of `cfg`'s train step, by part; `attention` is the implementation the
    target runs (jaxllm.model.visibility.resolve_attention), `trainable_bytes` the trainable parameters' bytes
    per device (their gradients are a temporary of that size). Offloaded activations
    (`host_activation_bytes`) are not counted."""
    m, mesh = cfg.model, cfg.mesh
    rows = _rows(cfg)
    terms = _layer_terms(cfg, rows, attention, _residual_split(cfg))
    whole_layer = sum(_layer_terms(cfg, rows, attention).values())
    saved = _SAVED[m.remat]
    if saved is not None and m.remat_offload == "host":
        saved = ("input",)
    kept = sum(terms.values()) if saved is None else sum(terms[k] for k in saved)
    head_positions = min(m.loss_chunk or cfg.train.seq_len, cfg.train.seq_len) / mesh.context
    head = 2 * rows * head_positions * m.vocab_size / mesh.tensor * FLOAT32  # logits and their gradient
    return {
        "saved_activations": kept * m.num_layers / mesh.stage,
        # a layer's backward working set: its recomputed forward (under remat none, its gradients instead)
        "layer_backward": whole_layer + _softmax_backward(cfg, rows, attention),
        "head": head,
        # the gradients; the update is written over the parameters and moments in place (jaxllm/train/step.py)
        "gradients": trainable_bytes,
    }
