"""A bare Llama train step in plain JAX, the yardstick of scripts/bench_peers.py; prints ONE JSON line last:
{"impl": "bare", "tokens_per_sec", "step_s", "compile_s", "params"}.

    python scripts/peers/bare_llama.py --layers 6 --dim 256 --heads 4 --kv_heads 4 --mlp_dim 688 --vocab 8000 \\
        --seq 256 --batch 8 --steps 12 --dtype bfloat16 --devices 8

The model of the peer harness's reference step, written the way a practitioner writes a minimal step: a dict of
arrays, layers stacked and scanned, one causal sequence per row (a constant mask and rotary table), RMSNorm and
the rotation and attention scores in float32, float32 weights cast to --dtype once at the top of the loss, untied
head, mean next-token cross-entropy (log-sum-exp minus the target logit). AdamW (b1 0.9, b2 0.95, eps 1e-8,
weight decay 0.1, lr 3e-4) after global-norm clipping at 1.0, one jitted step with the state donated, pure data
parallelism over --devices forced host devices: rows split, parameters and optimizer state replicated. It shares
no code with jaxllm; unlike jaxllm's step it does no packed-document masking, no anomaly checks and no norms.
"""

import argparse
import json
import math
import os
import sys
import time

EPS, THETA = 1e-5, 10000.0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 6), ("dim", 256), ("heads", 4), ("kv_heads", 4), ("mlp_dim", 688),
                          ("vocab", 8000), ("seq", 256), ("batch", 8), ("steps", 12), ("devices", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return p.parse_args(argv)


def init_params(key, a) -> dict:
    import jax
    import jax.numpy as jnp

    D, N, K, H, F, V, L = a.dim, a.heads, a.kv_heads, a.dim // a.heads, a.mlp_dim, a.vocab, a.layers
    shapes = dict(wq=((L, D, N * H), D), wk=((L, D, K * H), D), wv=((L, D, K * H), D), wo=((L, N * H, D), N * H),
                  w_gate=((L, D, F), D), w_up=((L, D, F), D), w_down=((L, F, D), F))
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {name: jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)
              for k, (name, (shape, fan_in)) in zip(keys, shapes.items())}
    layers.update(attn_norm=jnp.ones((L, D)), mlp_norm=jnp.ones((L, D)))
    return {"embed": jax.random.normal(keys[-2], (V, D)), "layers": layers, "final_norm": jnp.ones((D,)),
            "lm_head": 0.02 * jax.random.normal(keys[-1], (D, V))}


def make_loss(a, compute):
    import jax
    import jax.numpy as jnp
    import numpy as np

    T, N, K, H = a.seq, a.heads, a.kv_heads, a.dim // a.heads
    angles = np.arange(T, dtype=np.float32)[:, None] / THETA ** (np.arange(0, H, 2, dtype=np.float32) / H)
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    causal = np.tril(np.ones((T, T), bool))

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS) * w.astype(jnp.float32)).astype(
            x.dtype)

    def rope(x):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    def layer(h, w):
        B = h.shape[0]
        x = rms(h, w["attn_norm"])
        q = rope((x @ w["wq"]).reshape(B, T, N, H)).reshape(B, T, K, N // K, H)
        k, v = rope((x @ w["wk"]).reshape(B, T, K, H)), (x @ w["wv"]).reshape(B, T, K, H)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) / math.sqrt(H)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), -1).astype(compute)
        h = h + jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(B, T, N * H) @ w["wo"]
        x = rms(h, w["mlp_norm"])
        return h + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"], None

    def loss(params, tokens):
        p = jax.tree.map(lambda w: w.astype(compute), params)
        h, _ = jax.lax.scan(layer, jnp.take(p["embed"], tokens[:, :-1], axis=0), p["layers"])
        logits = (rms(h, p["final_norm"]) @ p["lm_head"]).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - gold)

    return loss


def main(argv) -> int:
    a = parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} " \
                              f"--xla_force_host_platform_device_count={a.devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()[:a.devices]), ("data",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
    loss = make_loss(a, jnp.dtype(a.dtype))

    def step(state, tokens):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    state = jax.jit(lambda key: (lambda p: (p, tx.init(p)))(init_params(key, a)), out_shardings=replicated)(
        jax.random.key(0))
    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (a.batch, a.seq + 1), 0, a.vocab), rows)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0,), in_shardings=(replicated, rows),
                       out_shardings=(replicated, replicated)).lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    for _ in range(2):  # warm up
        state, value = compiled(state, tokens)
    jax.block_until_ready(value)
    start = time.perf_counter()
    for _ in range(a.steps):
        state, value = compiled(state, tokens)
    jax.block_until_ready(value)
    step_s = (time.perf_counter() - start) / a.steps
    print(json.dumps({"impl": "bare", "tokens_per_sec": a.batch * a.seq / step_s, "step_s": step_s,
                      "compile_s": compile_s, "params": sum(x.size for x in jax.tree.leaves(state[0])),
                      "loss": float(value)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
