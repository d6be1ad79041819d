"""An independent train step in plain jax.numpy + optax, the yardstick of `scripts/bench_step.py`'s plain row.

The same network as jaxllm's (token embedding, RMSNorm, rotary GQA attention over packed documents, SwiGLU,
untied head; layers stacked and scanned) and the same update (global-norm clipping, AdamW), written the way a
practitioner would write a minimal step: a dict of arrays, no modules, no logical axes, no anomaly checks.
It runs data-parallel: rows split over every device, parameters replicated. It shares no code with jaxllm on
purpose, so a slowdown in jaxllm's step shows as a ratio.

Precision as a practitioner writes it (and as ../shared/peer/bare_llama.py): float32 parameters cast once to the
compute dtype (`precision.compute`) at the top of the loss; norms, rotations, attention scores and the loss in
float32, everything else in the compute dtype. In float32 every cast is a no-op.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec


def init_params(key, m) -> dict:
    """Parameters of ModelConfig `m`, float32, N(0, init_std^2) matrices and unit norms."""
    L, D, N, K, H, F, V = m.num_layers, m.dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
    shapes = dict(embed=(V, D), wq=(L, D, N * H), wk=(L, D, K * H), wv=(L, D, K * H), wo=(L, N * H, D),
                  wg=(L, D, F), wu=(L, D, F), wd=(L, F, D), head=(D, V))
    keys = jax.random.split(key, len(shapes))
    params = {name: m.init_std * jax.random.normal(k, shape, jnp.float32) for k, (name, shape) in zip(keys, shapes.items())}
    params.update(ln1=jnp.ones((L, D)), ln2=jnp.ones((L, D)), norm=jnp.ones((D,)))
    return params


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, sin, cos):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def loss_fn(params, batch, m, compute=jnp.float32):
    params = jax.tree.map(lambda w: w.astype(compute), params)  # float32 master weights -> compute dtype
    B, T = batch["tokens"].shape
    N, K, H = m.num_heads, m.num_kv_heads, m.head_dim
    inv_freq = 1.0 / m.rope_theta ** (jnp.arange(0, H, 2) / H)
    angles = batch["positions"][..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    seg = batch["segment_ids"]
    mask = (seg[:, :, None] == seg[:, None, :]) & (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])

    def layer(x, w):
        h = _rms(x, w["ln1"], m.norm_eps)
        q = _rope((h @ w["wq"]).reshape(B, T, K, N // K, H), sin[:, :, :, None], cos[:, :, :, None])
        k = _rope((h @ w["wk"]).reshape(B, T, K, H), sin, cos)
        v = (h @ w["wv"]).reshape(B, T, K, H)
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * H**-0.5
        probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), -1).astype(compute)
        x = x + jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, N * H) @ w["wo"]
        h = _rms(x, w["ln2"], m.norm_eps)
        return x + (jax.nn.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"], None

    layers = {k: params[k] for k in ("ln1", "wq", "wk", "wv", "wo", "ln2", "wg", "wu", "wd")}
    x, _ = jax.lax.scan(layer, params["embed"][batch["tokens"]], layers)
    logits = (_rms(x, params["norm"], m.norm_eps) @ params["head"]).astype(jnp.float32)
    logps = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)
    weight = batch["loss_mask"].astype(jnp.float32)
    return -jnp.sum(logps * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def make_step(cfg):
    """(jitted step(params, opt_state, batch) -> (params, opt_state, loss), optimizer) for Config `cfg`."""
    o = cfg.optim
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg.model, jnp.dtype(cfg.precision.compute))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), tx


def plain_step_throughput(cfg, batch: dict, steps: int, devices) -> dict:
    """Tokens/s of the plain step on `batch` (numpy, [B, T]) data-parallel over `devices`."""
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    rows, replicated = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    step, tx = make_step(cfg)
    params = jax.device_put(init_params(jax.random.key(cfg.train.seed), cfg.model), replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    batch = jax.device_put({k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}, rows)
    start = time.perf_counter()
    step = step.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - start
    for _ in range(2):  # warm up
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready(loss)
    elapsed = time.perf_counter() - start
    tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
    return dict(compile_s=compile_s, step_s=elapsed / steps, tokens_per_sec=steps * tokens / elapsed,
                loss=float(loss), temp_mb=step.memory_analysis().temp_size_in_bytes / 2**20)
