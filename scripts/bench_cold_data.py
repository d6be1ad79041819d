"""Token stores on a cold tier through the local cache (docs/storage.md):
`python scripts/bench_cold_data.py [--tokens 20000000] [--cold_mb_s 100] [--steps 300] [--out build/bench_cold]`.

Writes a synthetic token store of `--tokens` tokens (random documents of 100-2,000 tokens, a 32k vocabulary)
as the cold tier, read as a `file://` URL throttled to `--cold_mb_s` MB/s (the seeds' HDD tier: 100 MB/s), with
the cache on this machine's local disk. Prints:
- the two tiers' read rates: every chunk file read once through the throttled cold tier, and once from the
  cache's directory (the local tier);
- the loader's tokens/s (make_train_iterator, one process, chunks fetched `prefetch_steps` ahead) for two batch
  shapes, the default job's (16 x 128) and a llama_1b job's on one H200 (8 x 2,048), over `--steps` steps twice:
  the first pass with an empty cache (a first epoch) and the second again (after the first epoch), for cache
  sizes of 100%, 50%, 25% and 10% of the store; each process keeps only 4 decoded chunks in memory here, so the
  second pass reads the cache's files rather than memory;
- against what each job consumes (the default job on this CPU, measured by `--job_tokens_s`; llama_1b on one
  H200 from docs/benchmarks.md), the smallest cache that keeps the loader at least 2x ahead.
Ends with one JSON line.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from jaxllm.data import cold_cache
from jaxllm.data.cold_cache import ChunkCache
from jaxllm.data.pipeline import make_train_iterator
from jaxllm.data.token_store import write_token_store

ROOT = Path(__file__).resolve().parents[1]
# Tokens/s each job consumes: the default job (configs/pretrain.py) on this 2-core CPU (scripts/bench_tiers.py's
# one-tier median, 2026-12-06) and llama_1b on one H200 (docs/benchmarks.md, "Dense grid": 56,272 tokens/s).
JOBS = {"default job (16 x 128)": (16, 128, 3150.0), "llama_1b on one H200 (8 x 2048)": (8, 2048, 56272.0)}
FRACTIONS = (1.0, 0.5, 0.25, 0.1)


def make_store(path: Path, tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < tokens:
        n = int(rng.integers(100, 2000))
        docs.append(np.concatenate([[1], rng.integers(3, 32000, n - 2), [2]]))
        total += n
    tokenizer = path.parent / "tokenizer.model"
    tokenizer.write_bytes(b"synthetic")
    write_token_store(path, {"train": docs}, tokenizer_path=tokenizer, vocab_size=32000, bos_id=1, eos_id=2,
                      pad_id=0)


def tier_rates(url: str, store: Path, cache_dir: Path, mb_s: float) -> dict:
    """MB/s reading every token chunk once through the throttled cold tier (into the cache), then from the
    cache's files."""
    chunks = sorted((store / "train" / "tokens" / "c").iterdir(), key=lambda p: int(p.name))
    relatives = [f"train/tokens/c/{p.name}" for p in chunks]
    size = sum(p.stat().st_size for p in chunks)
    cache = ChunkCache(cache_dir, 1 << 40, slow_mb_s=mb_s)
    start = time.perf_counter()
    for relative in relatives:
        cache.read(url, relative)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for relative in relatives:
        cache.read(url, relative)
    local = time.perf_counter() - start
    return dict(store_mb=size / 1e6, chunks=len(chunks), cold_mb_s=size / cold / 1e6, local_mb_s=size / local / 1e6)


def loader_rate(url: str, cache: ChunkCache, batch: int, seq: int, steps: int) -> float:
    """Tokens/s of the loader over `steps` steps."""
    iterator = make_train_iterator(url, global_batch_size=batch, seq_len=seq, seed=0, num_steps=steps,
                                   num_workers=0, cache=cache, prefetch_steps=8)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    seconds = time.perf_counter() - start
    iterator.close()
    return batch * seq * steps / seconds


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--cold_mb_s", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--job_tokens_s", type=float, default=None, help="the default job's tokens/s on this machine")
    p.add_argument("--out", default="build/bench_cold")
    args = p.parse_args(argv)
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    store = out / "cold" / "store"
    store.parent.mkdir()
    make_store(store, args.tokens)
    url = f"file://{store}"
    cold_cache._DECODED_BYTES = 4 * (1 << 16) * 2  # 4 decoded chunks a process: the cache's files, not memory
    rates = tier_rates(url, store, out / "tiers-cache", args.cold_mb_s)
    print(f"store: {args.tokens:,} tokens, {rates['chunks']} chunks, {rates['store_mb']:.1f} MB; cold tier "
          f"{rates['cold_mb_s']:.0f} MB/s (throttled to {args.cold_mb_s:g}), local cache tier "
          f"{rates['local_mb_s']:.0f} MB/s")
    jobs = dict(JOBS)
    if args.job_tokens_s:
        batch, seq, _ = jobs["default job (16 x 128)"]
        jobs["default job (16 x 128)"] = (batch, seq, args.job_tokens_s)
    results = {"tiers": rates, "jobs": {}}
    print(f"{'job':34s} {'cache':>6s} {'first pass tok/s':>17s} {'after tok/s':>12s} {'job tok/s':>10s} "
          f"{'after / job':>11s}")
    for job, (batch, seq, consumes) in jobs.items():
        rows = []
        for fraction in FRACTIONS:
            cache_dir = out / f"cache-{batch}x{seq}-{fraction}"
            cache = ChunkCache(cache_dir, int(fraction * rates["store_mb"] * 1e6), slow_mb_s=args.cold_mb_s)
            first = loader_rate(url, cache, batch, seq, args.steps)
            after = loader_rate(url, cache, batch, seq, args.steps)
            rows.append(dict(cache_fraction=fraction, first_tokens_s=first, after_tokens_s=after,
                             after_over_job=after / consumes))
            print(f"{job:34s} {100 * fraction:5.0f}% {first:17,.0f} {after:12,.0f} {consumes:10,.0f} "
                  f"{after / consumes:11.1f}")
            shutil.rmtree(cache_dir, ignore_errors=True)
        enough = [r["cache_fraction"] for r in rows if r["after_over_job"] >= 2]
        needed = min(enough) if enough else None
        results["jobs"][job] = dict(consumes_tokens_s=consumes, rows=rows, smallest_cache_2x=needed)
        print(f"  smallest cache keeping the loader >= 2x ahead: "
              f"{f'{100 * needed:.0f}% of the store' if needed else 'none measured'}")
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
