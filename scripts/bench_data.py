"""Data-path throughput: preparation stages (MB/s), our near-dedup vs datasketch, loader (packed tokens/s).

    python scripts/bench_data.py [--synthetic_mb 20] [--steps 60] [--workers 2]

Prints one table. The synthetic corpus is word soup sampled from the shipped corpus's words with planted
exact (2%) and near duplicates (10%, 1-5 words changed), written to a temporary directory.
"""
import argparse
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxllm.data.dedup import Shingler, find_duplicates
from jaxllm.data.pipeline import make_train_iterator
from jaxllm.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "data" / "shakespeare.jsonl.gz"


def synthetic_corpus(path: Path, mb: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    with gzip.open(SHAKESPEARE, "rt") as f:
        words = [w for line in f for w in json.loads(line)["text"].split()]
    docs, size = [], 0
    while size < mb * 1e6:
        r = rng.random()
        if docs and r < 0.02:
            d = rng.choice(docs)
        elif docs and r < 0.12:
            ws = rng.choice(docs).split(" ")
            for _ in range(rng.randint(1, 5)):
                ws[rng.randrange(len(ws))] = rng.choice(words)
            d = " ".join(ws)
        else:  # independent word soup: unrelated documents share almost no 5-gram shingles
            d = " ".join(rng.choices(words, k=rng.randint(300, 800)))
        docs.append(d)
        size += len(d)
    with gzip.open(path, "wt", compresslevel=1) as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return len(docs)


def datasketch_dedup(texts, threshold=0.8, num_perm=128, ngram=5):
    import datasketch
    lsh = datasketch.MinHashLSH(threshold=threshold, num_perm=num_perm)
    sh = Shingler(ngram)
    removed, sigs = set(), []
    for i, t in enumerate(texts):
        m = datasketch.MinHash(num_perm=num_perm)
        m.update_batch([int(x).to_bytes(8, "little") for x in sh(t)])
        if any(sigs[j].jaccard(m) >= threshold for j in lsh.query(m)):
            removed.add(i)
        else:
            lsh.insert(i, m)
        sigs.append(m)
    return removed


def loader_tokens_per_s(store, batch, seq, workers, steps):
    it = make_train_iterator(store, global_batch_size=batch, seq_len=seq, seed=0, num_steps=steps + 5,
                             num_workers=workers)
    try:
        for _ in range(5):
            next(it)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        return steps * batch * seq / (time.perf_counter() - t0)
    finally:
        it.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic_mb", type=float, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--train_tokens_per_s", type=float, default=2000,
                    help="what the default training step consumes (make train on CPU)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpora = {"shakespeare (5 MB)": SHAKESPEARE}
        if args.synthetic_mb > 0:
            syn = tmp / "synthetic.jsonl.gz"
            n = synthetic_corpus(syn, args.synthetic_mb)
            corpora[f"synthetic ({args.synthetic_mb:g} MB, {n} docs)"] = syn
        stores = {}
        for name, path in corpora.items():
            out = tmp / f"ds{len(stores)}"
            r = prepare([path], out, vocab_size=512, log=lambda *a: None)
            stores[name] = out
            for stage, s in r.manifest["extra"]["prepare"]["stages"].items():
                rows.append((f"prepare/{stage}", name, f"{s['mb_per_s']:.2f} MB/s",
                             f"{s['docs_in']} -> {s['docs_out']} docs, {s['seconds']:.1f}s"))
            if "synthetic" in name:
                texts = [json.loads(l)["text"] for l in gzip.open(path, "rt")]
                mb = sum(len(t.encode()) for t in texts) / 1e6
                t0 = time.perf_counter()
                ours = set(np.flatnonzero(~find_duplicates(texts, exact=False).keep).tolist())
                t_ours = time.perf_counter() - t0
                try:
                    t0 = time.perf_counter()
                    theirs = datasketch_dedup(texts)
                    t_theirs = time.perf_counter() - t0
                    agree = len(ours & theirs) / max(len(ours | theirs), 1)
                    rows.append(("near-dedup jaxllm", name, f"{mb / t_ours:.2f} MB/s", f"{len(ours)} removed"))
                    rows.append(("near-dedup datasketch", name, f"{mb / t_theirs:.2f} MB/s",
                                 f"{len(theirs)} removed; Jaccard of removed sets {agree:.3f}"))
                except ImportError:
                    rows.append(("near-dedup datasketch", name, "-", "datasketch not installed"))
        store = stores["shakespeare (5 MB)"]
        for b, s in ((16, 128), (64, 512)):
            for w in (0, args.workers):
                tps = loader_tokens_per_s(store, b, s, w, args.steps)
                rows.append((f"loader {b}x{s}", f"workers={w}", f"{tps / 1e6:.2f} M tok/s",
                             f"{tps / args.train_tokens_per_s:.0f}x the training step's {args.train_tokens_per_s:g} tok/s"))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
