"""Decode throughput against the memory-bandwidth bound:
`python scripts/bench_decode.py --config configs/gpu/llama_1b_h200.py [--batches 1,8,64] [--prompt 512]
[--new 512] [--bandwidth 4.8e12] [--profile DIR]`.

The config's model (random weights, in its compute dtype: a served model's weights are not float32) decodes
greedily with jaxllm.model.sample's KV-cache loop (prefill, then one token per step in one jitted call) at each
batch size. Two calls share one compiled program (the same cache bucket; `max_new_tokens` is a traced value): one
generating 16 tokens and one generating `--new`, so their time difference is `--new` - 16 decode steps with the
prefill cancelled out. A decode step reads every weight once and each row's whole KV cache (the loop attends over
all cache slots, masked), so its bound is

    tokens/s <= B x bandwidth / (parameter bytes + B x KV-cache bytes per row)

printed beside the measured figure, with their ratio. Ends with one JSON line. `--profile DIR` traces one more
long call at the first batch size with jax.profiler into DIR (read it with scripts/profile_breakdown.py, or Perfetto),
to see where a step's time goes beyond reading the weights.
"""

import json
import sys
import time

from jaxllm.config.cli import UsageError, fail
from jaxllm.config.schema import ConfigError

SHORT = 16  # tokens of the call whose time (prefill + 16 steps) is subtracted


def kv_bytes_per_row(model_cfg, cache_len: int, itemsize: int) -> int:
    """Bytes of one row's keys and values over every layer and cache slot."""
    return 2 * model_cfg.num_layers * cache_len * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


def prompts(cfg, batch: int, prompt: int):
    """(tokens [batch, prompt], start [batch]): random full-length prompts, the same for every call."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(1, cfg.model.vocab_size, (batch, prompt)).astype(np.int32)
    return tokens, np.zeros((batch,), np.int32)


def timed_decode(graphdef, params, tokens, start, new: int) -> float:
    """Seconds of one decode call (after a warm-up call of the same shape)."""
    import jax

    from jaxllm.model.sample import decode

    jax.block_until_ready(decode(graphdef, params, tokens, start, max_new_tokens=new))
    begin = time.perf_counter()
    jax.block_until_ready(decode(graphdef, params, tokens, start, max_new_tokens=new))
    return time.perf_counter() - begin


def measure(cfg, batch: int, prompt: int, new: int, bandwidth: float, graphdef, params) -> dict:
    """Decode tokens/s at `batch` rows against the bandwidth bound."""
    import jax

    from jaxllm.model.sample import bucket

    tokens, start = prompts(cfg, batch, prompt)
    short, long = timed_decode(graphdef, params, tokens, start, SHORT), timed_decode(graphdef, params, tokens,
                                                                                      start, new)
    tokens_per_sec = batch * (new - SHORT) / (long - short)
    cache_len = bucket(prompt + new)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv = kv_bytes_per_row(cfg.model, cache_len, jax.tree.leaves(params)[0].dtype.itemsize)
    bound = batch * bandwidth / (param_bytes + batch * kv)
    return dict(batch=batch, prompt=prompt, new=new, cache_len=cache_len, tokens_per_sec=tokens_per_sec,
                step_ms=1e3 * batch / tokens_per_sec, prefill_and_16_s=short, param_bytes=param_bytes,
                kv_bytes_per_row=kv, bound_tokens_per_sec=bound, of_bound=tokens_per_sec / bound)


def trace_decode(graphdef, params, cfg, batch: int, prompt: int, new: int, out_dir: str) -> None:
    """One more long decode call (already compiled by `measure`) under jax.profiler, into `out_dir`."""
    import jax

    from jaxllm.model.sample import decode

    tokens, start = prompts(cfg, batch, prompt)
    with jax.profiler.trace(out_dir):
        jax.block_until_ready(decode(graphdef, params, tokens, start, max_new_tokens=new))
    print(f"trace of one {new}-token call at batch {batch} in {out_dir}", flush=True)


def _arguments(p) -> None:
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=512, help="generated tokens of the long call (> 16)")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bytes/s of the bound (H200: 4.8e12)")
    p.add_argument("--profile", default=None, help="directory for a jax.profiler trace of one long call")


def main(argv):
    from bench_step import bench_arguments

    args, cfg = bench_arguments(argv, __doc__, steps=None, add=_arguments)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if args.new <= SHORT or min(batches) < 1:
            raise UsageError(f"--new must exceed {SHORT} and every batch be >= 1")
        from jaxllm.model.sample import bucket

        if bucket(args.prompt + SHORT) != bucket(args.prompt + args.new):
            raise UsageError(f"--prompt {args.prompt} + --new {args.new} must fall in the cache bucket of --prompt + "
                             f"{SHORT} ({bucket(args.prompt + SHORT)}), so both calls run one program")
    except (ConfigError, UsageError, ValueError) as exc:
        fail(str(exc))
    import dataclasses

    import jax
    from flax import nnx

    from jaxllm.model.build import build_model

    precision = dataclasses.replace(cfg.precision, params=cfg.precision.compute)
    graphdef, params = nnx.split(build_model(cfg.model, precision, jax.random.key(0)))
    rows = []
    print(f"{'batch':>5} {'tokens/s':>10} {'step ms':>8} {'bound tokens/s':>15} {'of bound':>9}  "
          f"({jax.devices()[0].device_kind}, cache {args.prompt}+{args.new}, {precision.params})")
    for batch in batches:
        row = measure(cfg, batch, args.prompt, args.new, args.bandwidth, graphdef, params)
        rows.append(row)
        print(f"{batch:>5} {row['tokens_per_sec']:>10,.0f} {row['step_ms']:>8.2f} {row['bound_tokens_per_sec']:>15,.0f} "
              f"{row['of_bound']:>9.3f}", flush=True)
    if args.profile:
        trace_decode(graphdef, params, cfg, batches[0], args.prompt, args.new, args.profile)
    print(json.dumps({"bench": "decode", "config": args.config, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
