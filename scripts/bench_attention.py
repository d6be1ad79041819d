"""Benchmark attention implementations: `python scripts/bench_attention.py [--batch 4 --seq 2048 ...]`.

Times one jitted forward + backward of causal grouped-query attention over packed documents (random document
boundaries, some rows ending in padding), and checks each implementation against a float32 reference:
  xla            jaxllm's einsum attention (`model.attention=xla`), dense [B, T, S] mask
  dot_product    jax.nn.dot_product_attention, XLA backend, same mask (`model.attention=dot_product`)
  cudnn          cuDNN fused kernel with the packed-document layout (`model.attention=cudnn`); with more
                 documents per row than --max_segments, the masked kernel below
  cudnn_mask     jax.nn.dot_product_attention's cuDNN kernel with the same mask, as a dense bias
  cudnn_causal   cuDNN causal mask only: ignores document boundaries, so wrong for packed data; a speed bound
The cuDNN rows need a GPU. Errors are max |difference| against the float32 reference over real-token rows,
relative to the reference's max |value|; xla/this is the speed-up over the `xla` row of the same run. Prints a
table and one JSON line.
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.cudnn_attention import cudnn_attention
from jaxllm.model.layers import xla_attention
from jaxllm.model.visibility import PACKED_DOCUMENTS, attention_mask, packed_segments


def random_documents(batch: int, seq: int, docs: int, seed: int) -> np.ndarray:
    """[B, T] 1-based document ids with `docs` documents per row at random boundaries; odd rows end in padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        used = seq - (rng.integers(1, seq // 8) if b % 2 else 0)
        cuts = np.sort(rng.choice(np.arange(1, used), size=docs - 1, replace=False)) if docs > 1 else []
        seg[b, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
    return seg


def implementations(max_segments: int) -> dict:
    """name -> attention(q, k, v, segment_ids); masks and layouts are built inside, as in the model."""
    impls = {
        "xla": lambda q, k, v, seg: xla_attention(q, k, v, attention_mask(seg)),
        "dot_product": lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, mask=attention_mask(seg)[:, None]),
    }
    if jax.default_backend() == "gpu":
        impls["cudnn"] = lambda q, k, v, seg: cudnn_attention(q, k, v, packed_segments(seg, max_segments))
        impls["cudnn_mask"] = lambda q, k, v, seg: jax.nn.dot_product_attention(
            q, k, v, mask=attention_mask(seg)[:, None], implementation="cudnn")
        impls["cudnn_causal"] = lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                 implementation="cudnn")
    return impls


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=4, help="documents packed per row")
    p.add_argument("--max_segments", type=int, default=PACKED_DOCUMENTS,
                   help="cudnn: runs per row of its packed layout (rows with more use the masked kernel)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated implementations to run (default: all)")
    args = p.parse_args(argv)
    B, T, N, K, H = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    if args.docs < 1 or args.docs >= T or args.max_segments < 1:
        p.error("need 1 <= --docs < --seq and --max_segments >= 1")

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, K, H), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, K, H), jnp.float32)
    cotangent = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    segment_ids = jnp.asarray(random_documents(B, T, args.docs, seed=0))
    real_BT = np.asarray(segment_ids) > 0

    def fwd_bwd(attention, dtype):
        # Every array is an argument: captured ones get constant-folded by XLA, for minutes at these sizes.
        def loss(q, k, v, cotangent, segment_ids):
            out = attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), segment_ids)
            return (out.astype(jnp.float32) * cotangent).sum(), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    with jax.default_matmul_precision("highest"):
        (_, ref_out), ref_grads = fwd_bwd(implementations(args.max_segments)["xla"], jnp.float32)(q, k, v, cotangent,
                                                                                      segment_ids)
    reference = [np.asarray(x) for x in (ref_out, *ref_grads)]

    def relative_error(got, want, rows):
        got, want = np.asarray(got, np.float32)[rows], want[rows]
        return float(np.abs(got - want).max() / np.abs(want).max())

    # Causal attention FLOPs, forward (QK^T and PV: 2 matmuls of 2*T*S*H each, half the square) and backward (2.5x).
    flops = 3.5 * 2 * 2 * B * N * T * T * H / 2
    dtype = jnp.dtype(args.dtype)
    rows = []
    wanted = set(filter(None, args.only.split(",")))
    for name, attention in implementations(args.max_segments).items():
        if wanted and name not in wanted:
            continue
        step = fwd_bwd(attention, dtype)
        try:
            start = time.perf_counter()
            (_, out), grads = step(q, k, v, cotangent, segment_ids)
            jax.block_until_ready(grads)
            compile_s = time.perf_counter() - start
        except Exception as exc:  # an implementation this backend or cuDNN version lacks: say so, go on
            rows.append(dict(impl=name, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
            continue
        start = time.perf_counter()
        for _ in range(args.steps):
            result = step(q, k, v, cotangent, segment_ids)
        jax.block_until_ready(result)
        seconds = (time.perf_counter() - start) / args.steps
        # Padding rows (segment 0) attend among themselves; only real tokens' rows (queries, keys) matter.
        errors = [relative_error(got, want, real_BT) for got, want in zip((out, *grads), reference)]
        rows.append(dict(impl=name, compile_s=compile_s, ms=1000 * seconds, tflops=flops / seconds / 1e12,
                         err_out=errors[0], err_dq=errors[1], err_dk=errors[2], err_dv=errors[3]))

    print(f"attention fwd+bwd | B{B} T{T} N{N}/K{K} H{H} | {args.docs} documents per row | {dtype} | "
          f"{jax.devices()[0].device_kind}")
    baseline_ms = next((r["ms"] for r in rows if r["impl"] == "xla" and "ms" in r), None)
    print(f"{'impl':<13} {'compile s':>9} {'ms':>9} {'xla/this':>8} {'TFLOP/s':>8} {'err out':>9} {'err dq':>9} "
          f"{'err dk':>9} {'err dv':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<13} failed: {r['error']}")
            continue
        speedup = f"{baseline_ms / r['ms']:>8.2f}" if baseline_ms else f"{'-':>8}"
        print(f"{r['impl']:<13} {r['compile_s']:>9.2f} {r['ms']:>9.3f} {speedup} {r['tflops']:>8.1f} "
              f"{r['err_out']:>9.2e} {r['err_dq']:>9.2e} {r['err_dk']:>9.2e} {r['err_dv']:>9.2e}")
    print(json.dumps({"bench": "attention", "shape": dict(B=B, T=T, N=N, K=K, H=H), "dtype": str(dtype),
                      "device": jax.devices()[0].device_kind, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
