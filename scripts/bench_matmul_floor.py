"""The matrix-product floor of the peer benchmark's Llama step: how long its matmuls alone take.

    python scripts/bench_matmul_floor.py [--config small] [--dtype bfloat16] [--devices 1] [--steps 12]
                                         [--step_tokens_per_sec N --maxtext_tokens_per_sec N]

Every step of the same Llama (scripts/peers/bare_llama.py's shapes: `make bench-peers`) multiplies the same
matrices, whoever writes it: per layer the q/k/v/o and gate/up/down projections, the attention scores and their
weighted sum, the head, each forward and twice backward. This runs exactly those products under jax.grad, with
nothing else between them (no norms, softmax, RoPE, masks, loss or optimizer: the activations pass straight from
one product to the next), on one batch of the benchmark's shape and dtype, and prints its tokens/s. A step cannot
be faster than its products; the ratio of a measured step to this floor is the share left to everything else.
With the measured tokens/s of jaxllm's step and MaxText's (the `make bench-peers` table) it prints both ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench_peers import CONFIGS  # the peer benchmark's shapes (scripts/ is on the path when run as a script)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=tuple(CONFIGS), default="small")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step_tokens_per_sec", type=float, default=0.0, help="jaxllm's step, for the ratio")
    p.add_argument("--maxtext_tokens_per_sec", type=float, default=0.0, help="MaxText's step, for the ratio")
    return p.parse_args(argv)


def products_only(shape: dict, dtype):
    """(loss_fn(weights, x), weights, x): the step's matrix products chained with nothing between them."""
    import jax
    import jax.numpy as jnp

    D, H, Kv, F, V, L = (shape[k] for k in ("dim", "heads", "kv_heads", "mlp_dim", "vocab", "layers"))
    hd = D // H
    key = iter(jax.random.split(jax.random.key(0), 8 * L + 2))
    weight = lambda *s: (jax.random.normal(next(key), s, jnp.float32) * 0.02)  # noqa: E731
    layers = [dict(q=weight(D, H * hd), k=weight(D, Kv * hd), v=weight(D, Kv * hd), o=weight(H * hd, D),
                   gate=weight(D, F), up=weight(D, F), down=weight(F, D)) for _ in range(L)]
    weights = dict(layers=layers, head=weight(D, V))
    B, T = shape["batch"], shape["seq"]
    x = jax.random.normal(next(key), (B, T, D), jnp.float32).astype(dtype)

    def loss_fn(w, x_BTD):
        h = x_BTD
        for layer in w["layers"]:
            c = {k: v.astype(dtype) for k, v in layer.items()}
            q = (h @ c["q"]).reshape(B, T, H, hd)
            k = jnp.repeat((h @ c["k"]).reshape(B, T, Kv, hd), H // Kv, axis=2)
            v = jnp.repeat((h @ c["v"]).reshape(B, T, Kv, hd), H // Kv, axis=2)
            scores = jnp.einsum("BTNH,BSNH->BNTS", q, k)
            attended = jnp.einsum("BNTS,BSNH->BTNH", scores, v).reshape(B, T, H * hd)
            h = h + attended @ c["o"]
            h = h + ((h @ c["gate"]) + (h @ c["up"])) @ c["down"]
        logits = h @ w["head"].astype(dtype)
        return jnp.sum(logits.astype(jnp.float32)) * 1e-6

    return loss_fn, weights, x


def main(argv) -> int:
    a = parse_args(argv)
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={a.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    shape = CONFIGS[a.config]
    loss_fn, weights, x = products_only(shape, jnp.dtype(a.dtype))
    if a.devices > 1:  # pure data parallelism over the batch, as the benchmark's 8-device rows
        mesh = jax.make_mesh((a.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    grad = jax.jit(jax.grad(loss_fn))
    start = time.perf_counter()
    jax.block_until_ready(grad(weights, x))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        jax.block_until_ready(grad(weights, x))
        times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_sec = shape["batch"] * shape["seq"] / step_s
    result = {"config": a.config, "dtype": a.dtype, "devices": a.devices, "floor_tokens_per_sec": tokens_per_sec,
              "floor_step_s": step_s, "compile_s": compile_s}
    for name in ("step", "maxtext"):
        measured = getattr(a, f"{name}_tokens_per_sec")
        if measured:  # the floor's tokens/s over the step's: how many times the products alone the step takes
            result[f"{name}_time_over_floor"] = tokens_per_sec / measured
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
