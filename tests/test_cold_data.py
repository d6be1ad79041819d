"""Token stores on a cold tier read through the local cache (jaxllm/data/cold_cache.py), and weighted mixtures
(`data.mixture`): the same batches as a local read, a size bound kept by evicting the least recently used
chunks, damaged cache entries fetched again, several processes on one cache, realised mixture shares logged."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train_runs import losses, metrics, resume_command, train_env

from jaxllm.config.schema import ConfigError, DataConfig
from jaxllm.data.cold_cache import MIRRORED, ChunkCache, _put_in_place
from jaxllm.data.pipeline import MixtureRows, PackedRows, make_train_iterator
from jaxllm.data.token_store import TokenStore

# A store's token chunks are 64k tokens (about 60 kB compressed): this bound holds a few of the shipped
# corpus's 41, so reading across it evicts all the time.
SMALL_CACHE = 300_000


def _chunk_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for p in (cache_dir / "chunks").rglob("*") if p.is_file())


def _batches(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_a_cold_store_reads_the_same_batches_through_a_bounded_cache(shakespeare_store, tmp_path):
    url = f"file://{shakespeare_store}"
    cache = ChunkCache(tmp_path / "cache", SMALL_CACHE)
    kw = dict(global_batch_size=64, seq_len=32, seed=1, num_steps=40, num_workers=0)
    direct = _batches(make_train_iterator(str(shakespeare_store), **kw), 30)
    cold = make_train_iterator(url, cache=cache, prefetch_steps=4, **kw)
    for want, got in zip(direct, _batches(cold, 30)):
        for field in want:
            np.testing.assert_array_equal(want[field], got[field])
    stats = cache.stats()  # the index holds at most the bound at every moment (the loader's threads still fetch)
    assert stats["evicted"] > 0 and stats["stored_bytes"] <= SMALL_CACHE, stats
    # Resume at step 20 through the cache: the data order is that of the local store.
    resumed = make_train_iterator(url, cache=cache, start_step=20, **kw)
    for want, got in zip(direct[20:], _batches(resumed, 10)):
        np.testing.assert_array_equal(want["tokens"], got["tokens"])


def test_a_damaged_or_missing_cache_entry_is_fetched_again(shakespeare_store, tmp_path):
    url = f"file://{shakespeare_store}"
    split = TokenStore.open(url, ChunkCache(tmp_path / "cache", 10**9)).split("train")
    want = split.read(1000, 2000).copy()
    (entry,) = [p for p in (tmp_path / "cache" / "chunks").rglob("*") if p.is_file()]
    entry.write_bytes(bytes(len(entry.read_bytes())))  # same size, zeros: only the checksum can tell
    cache = ChunkCache(tmp_path / "cache", 10**9)  # a fresh process's view: nothing decoded in memory
    again = TokenStore.open(url, cache).split("train")
    np.testing.assert_array_equal(again.read(1000, 2000), want)
    assert cache.stats()["misses"] == 1
    entry.unlink()
    third = ChunkCache(tmp_path / "cache", 10**9)
    np.testing.assert_array_equal(TokenStore.open(url, third).split("train").read(1000, 2000), want)
    assert third.stats()["misses"] == 1


READER = """
import sys
import numpy as np
from jaxllm.data.cold_cache import MIRRORED, ChunkCache, _put_in_place
from jaxllm.data.token_store import TokenStore
store, cache_dir, bound, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
local = TokenStore.open(store).split("train")
cold = TokenStore.open("file://" + store, ChunkCache(cache_dir, bound)).split("train")
rng = np.random.default_rng(seed)
for _ in range(150):
    cold.cold._decoded = None  # every read through the shared cache, none from this process's memory
    a = int(rng.integers(0, local.num_tokens - 70000))
    b = a + int(rng.integers(1, 70000))
    assert np.array_equal(cold.read(a, b), local.read(a, b)), (a, b)
print("ok")
"""


def test_processes_share_one_bounded_cache(shakespeare_store, tmp_path):
    """Three processes read random ranges at once through one small cache (each fetch evicts another's
    chunks): every read equals the local store's, and the bound holds."""
    script = tmp_path / "reader.py"
    script.write_text(READER)
    procs = [subprocess.Popen([sys.executable, str(script), str(shakespeare_store), str(tmp_path / "cache"),
                               str(SMALL_CACHE), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(3)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert _chunk_bytes(tmp_path / "cache") <= SMALL_CACHE


def test_mixture_shares_are_exact_per_block_and_reported_per_step(shakespeare_store, tmp_path):
    split = TokenStore.open(shakespeare_store).split("train")
    sources = [PackedRows(split, 32, seed) for seed in (1, 2, 3)]
    mix = MixtureRows(sources, [5, 3, 2], seed=1, block=1000, names=["web", "code", "books"])
    assert mix.fractions(np.arange(2000, 3000)) == {"web": 0.5, "code": 0.3, "books": 0.2}  # a whole block: exact
    iterator = make_train_iterator([(shakespeare_store, 5), (shakespeare_store, 3)], global_batch_size=16,
                                   seq_len=32, seed=1, num_steps=200, num_workers=0)
    shares = []
    for _ in range(200):
        next(iterator)
        shares.append(iterator.step_metrics())
    assert set(shares[0]) == {"data_index", "data/mix/shakespeare.0", "data/mix/shakespeare.1"}
    assert [s["data_index"] for s in shares] == list(range(200))
    mean = np.mean([s["data/mix/shakespeare.0"] for s in shares])
    assert abs(mean - 5 / 8) < 0.02, mean  # 3,200 rows of a 4,096-row block: within sampling of the weight


def test_mixture_and_cache_settings_are_checked():
    assert DataConfig(mixture="a:0.7, s3://bucket/b:0.3", cache_dir="/c").mixture_pairs() == [
        ("a", 0.7), ("s3://bucket/b", 0.3)]
    for bad in ("a", "a:x", "a:0", ":1"):
        with pytest.raises(ConfigError, match="data.mixture"):
            DataConfig(mixture=bad).check()
    with pytest.raises(ConfigError, match="data.cache_dir: s3://b/store is a URL"):
        DataConfig(path="s3://b/store").check()


def test_a_run_on_a_cold_mixture_trains_on_the_same_data(shakespeare_store, uninterrupted, tmp_path):
    """The shared reference job, its store read from a cold URL through a small cache as a one-store mixture:
    the same batches (a one-store mixture is the store itself), so the same losses bit for bit; the share is
    logged each step."""
    url = f"file://{shakespeare_store}"
    command = resume_command(shakespeare_store, tmp_path / "run", "--config.train.steps=8",
                             f"--config.data.mixture={url}:1", f"--config.data.cache_dir={tmp_path / 'cache'}",
                             f"--config.data.cache_gb={SMALL_CACHE / 1e9}", f"--config.data.path={url}")
    proc = subprocess.run(command, capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "run") == losses(uninterrupted)
    records = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert all(r[f"data/mix/{shakespeare_store.name}"] == 1.0 for r in records)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["mixture"] == f"{url}:1"


def test_a_mirror_another_process_put_in_place_stays_and_a_stale_one_is_replaced(tmp_path):
    """Two processes mirror a store at once: the second to finish keeps the first's mirror in place (others
    may be reading it) and drops its own; a mirror of another manifest is replaced."""
    def mirror_dir(name, manifest, extra=None):
        directory = tmp_path / name
        directory.mkdir()
        (directory / MIRRORED).write_bytes(manifest)
        if extra:
            (directory / extra).write_text("x")
        return directory

    target = mirror_dir("store", b"v1", extra="in use")
    assert not _put_in_place(mirror_dir("store.tmp-1", b"v1"), target, b"v1")
    assert (target / "in use").is_file() and not (tmp_path / "store.tmp-1").exists()
    assert _put_in_place(mirror_dir("store.tmp-2", b"v2"), target, b"v2")
    assert (target / MIRRORED).read_bytes() == b"v2" and not (target / "in use").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
