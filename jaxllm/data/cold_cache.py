"""Token stores on a cold tier, read through a size-bounded local cache (`data.cache_dir`, `data.cache_gb`).

A store may live at a path or an fsspec URL (`file://`, `s3://`, `gs://`, ... with the matching fsspec
package). Its small files (manifest, tokenizer, array metadata, document offsets) are mirrored once into
`<cache_dir>/stores/<key>/` and never evicted; its token chunks (the zarr3 chunk files, 64k tokens each) are
fetched on demand into `<cache_dir>/chunks/<key>/` and evicted least recently used past the size bound.

Why by hand: tensorstore caches only in memory, and fsspec's `filecache`/`blockcache` keep no size bound across
processes and no checksums. Why not through tensorstore: reading a chunk file that is missing (evicted by
another process between a check and the read) gives the array's fill value, silently wrong tokens; here a
chunk is read whole into memory under its checksum and decoded (zstd, as the store wrote it), so eviction at
any moment only costs a refetch.

Several worker processes and several jobs on a node share one cache: the index is SQLite (its locking
serialises updates; a fetch evicts and records in one transaction, so the index never holds more than the
bound), files are written to a temporary name and renamed into place, and a reader that finds a file gone or
damaged (size or CRC-32 not those recorded at fetch) fetches it again. On disk the cache may exceed the bound
by the chunks being fetched at that moment (one per fetching thread); a process killed in a fetch can leave
that one chunk's file behind, outside the index.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import numpy as np
import zstandard

from jaxllm.runtime.throttle import Throttle

MIRRORED = "manifest.json"  # the store's file whose presence marks a complete mirror
_DECODED_BYTES = 64 << 20  # decoded chunks kept in each process's memory (as tensorstore's cache pool)
_TOUCH_EVERY_S = 5.0  # a chunk's last use is written to the index at most this often per process


def _is_mirror_of(directory: Path, manifest: bytes) -> bool:
    return (directory / MIRRORED).is_file() and (directory / MIRRORED).read_bytes() == manifest


def _put_in_place(temporary: Path, target: Path, manifest: bytes) -> bool:
    """Rename the finished mirror `temporary` to `target`; whether it went in. A mirror of the same manifest that
    another process put there meanwhile stays (others may be reading it: removing it first, as this once did, left
    them a moment with no manifest) and ours goes; a stale one is moved aside first."""
    try:
        os.rename(temporary, target)  # atomic; fails while `target` holds files
        return True
    except OSError:
        pass
    if not _is_mirror_of(target, manifest):
        aside = target.with_name(f"{temporary.name}.stale")
        with contextlib.suppress(OSError):
            os.rename(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rename(temporary, target)
            return True
    shutil.rmtree(temporary, ignore_errors=True)
    return False


def is_url(path: str) -> bool:
    return "://" in str(path)


def normalize_location(location: str) -> str:
    """A store's location as the cache names it: a URL as given, a path made absolute."""
    return str(location).rstrip("/") if is_url(location) else str(Path(location).absolute())


def store_key(location: str) -> str:
    """The cache's directory name for a store: its last path part and a hash of the whole location."""
    name = str(location).rstrip("/").rsplit("/", 1)[-1] or "store"
    return f"{name}-{hashlib.sha256(str(location).encode()).hexdigest()[:12]}"


class ChunkCache:
    """The local cache of cold token stores under `directory`, at most `max_bytes` of chunks. Picklable (grain
    worker processes get it): the index connection, the prefetch threads and the throttle are per process.
    `slow_mb_s` (drills and benchmarks): the cold tier's emulated bandwidth (0: as fast as it is)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, slow_mb_s: float = 0.0, prefetch_threads=4):
        self.directory = Path(directory).absolute()
        self.max_bytes, self.slow_mb_s, self.prefetch_threads = int(max_bytes), float(slow_mb_s), prefetch_threads
        self._local = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_local"} | {"_local": None}

    def _process(self) -> "_ProcessState":
        if self._local is None or self._local.pid != os.getpid():
            self._local = _ProcessState(self.directory, self.slow_mb_s, self.prefetch_threads)
        return self._local

    # -- the small files, mirrored whole ---------------------------------------------------------------------

    def mirror(self, location: str) -> Path:
        """The local mirror of the store at `location` (its small files; chunks come through `read`), made on
        first use and kept; a mirror whose manifest no longer equals the cold store's is made again."""
        fs, root = fsspec.core.url_to_fs(str(location))
        target = self.directory / "stores" / store_key(location)
        try:
            manifest = fs.cat_file(f"{root}/{MIRRORED}")
        except FileNotFoundError:
            raise FileNotFoundError(f"no token store at {location}: expected {location}/{MIRRORED}") from None
        if _is_mirror_of(target, manifest):
            return target
        temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(temporary, ignore_errors=True)
        # The store's top-level files (manifest, tokenizer) and each split's array metadata and offsets: never a
        # listing of the token chunks (a large store has millions) nor of the preparation's stage outputs.
        splits = json.loads(manifest).get("splits", {})
        wanted = [p for p in fs.ls(root, detail=False) if fs.isfile(p)]
        for split in splits:
            wanted += [f"{root}/{split}/tokens/zarr.json", *fs.find(f"{root}/{split}/doc_offsets")]
        for path in wanted:
            relative = path.rstrip("/")[len(root.rstrip("/")):].lstrip("/")
            (temporary / relative).parent.mkdir(parents=True, exist_ok=True)
            (temporary / relative).write_bytes(fs.cat_file(path))
        (temporary / MIRRORED).write_bytes(manifest)
        if _put_in_place(temporary, target, manifest):
            self._process().forget_chunks(store_key(location))  # a changed store's old chunks must not be read
        return target

    # -- the chunks, fetched on demand ----------------------------------------------------------------------

    def read(self, location: str, relative: str) -> bytes:
        """The bytes of the store's file `relative` (a token chunk), from the cache or fetched into it."""
        return self._process().read(location, relative, self.max_bytes)

    def prefetch(self, location: str, relatives: list[str]) -> None:
        """Fetch these files into the cache in the background (those already there are left)."""
        self._process().prefetch(location, relatives, self.max_bytes)

    def stats(self) -> dict:
        """This process's hits, misses (fetches), fetched bytes and evictions so far, and the bytes the cache
        holds (all processes')."""
        state = self._process()
        return dict(state.counts, stored_bytes=state.stored_bytes())


class _ProcessState:
    """One process's side of the cache: its SQLite connection, prefetch threads and cold-tier throttle."""

    def __init__(self, directory: Path, slow_mb_s: float, threads: int):
        self.pid = os.getpid()
        self.directory = directory
        (directory / "chunks").mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(directory / "index.sqlite", timeout=120, isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS chunks (key TEXT PRIMARY KEY, size INTEGER, crc INTEGER, "
                        "used REAL)")
        self.db_lock = threading.Lock()  # one connection, several threads: one statement at a time
        self.throttle = Throttle(slow_mb_s)
        self.pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="jaxllm-cold-prefetch")
        self.in_flight: dict[str, object] = {}
        self.flight_lock = threading.Lock()
        self.touched: dict[str, float] = {}
        self.counts = collections.Counter(hits=0, misses=0, fetched_bytes=0, evicted=0)

    def _sql(self, statement: str, *args):
        with self.db_lock:
            return self.db.execute(statement, args).fetchall()

    def read(self, location: str, relative: str, max_bytes: int) -> bytes:
        key = f"{store_key(location)}/{relative}"
        with self.flight_lock:
            pending = self.in_flight.get(key)
        if pending is not None:  # being prefetched: wait for it rather than fetch it twice
            pending.result()
        data = self._cached(key)
        if data is not None:
            self.counts["hits"] += 1
            return data
        self.counts["misses"] += 1
        return self._fetch(location, relative, key, max_bytes)

    def _cached(self, key: str) -> bytes | None:
        row = self._sql("SELECT size, crc FROM chunks WHERE key = ?", key)
        if not row:
            return None
        try:
            data = (self.directory / "chunks" / key).read_bytes()
        except FileNotFoundError:  # evicted since the lookup
            return None
        if len(data) != row[0][0] or zlib.crc32(data) != row[0][1]:
            return None  # damaged: fetched again (and the record replaced)
        now = time.time()
        if now - self.touched.get(key, 0.0) > _TOUCH_EVERY_S:
            self.touched[key] = now
            self._sql("UPDATE chunks SET used = ? WHERE key = ?", now, key)
        return data

    def _fetch(self, location: str, relative: str, key: str, max_bytes: int) -> bytes:
        fs, root = fsspec.core.url_to_fs(str(location))
        data = fs.cat_file(f"{root}/{relative}")
        self.throttle.pass_bytes(len(data))
        path = self.directory / "chunks" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        for victim in self._admit(key, len(data), zlib.crc32(data), max_bytes):
            (self.directory / "chunks" / victim).unlink(missing_ok=True)
        self.counts["fetched_bytes"] += len(data)
        return data

    def _admit(self, key: str, size: int, crc: int, max_bytes: int) -> list[str]:
        """Record `key` in the index, first dropping the least recently used records until it fits in
        `max_bytes`, in one transaction (so the index never holds more, whatever the processes do at once);
        the keys dropped, whose files the caller deletes. A file is written before its record: a record whose
        file an eviction deleted meanwhile is only a miss, fetched again."""
        with self.db_lock:
            self.db.execute("BEGIN IMMEDIATE")  # one writer at a time, across processes
            try:
                total = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks WHERE key != ?",
                                        (key,)).fetchone()[0]
                victims = []
                for victim, victim_size in self.db.execute("SELECT key, size FROM chunks WHERE key != ? "
                                                           "ORDER BY used", (key,)).fetchall():
                    if total + size <= max_bytes:
                        break
                    victims.append(victim)
                    total -= victim_size
                self.db.executemany("DELETE FROM chunks WHERE key = ?", [(v,) for v in victims])
                self.db.execute("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?)", (key, size, crc, time.time()))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        self.counts["evicted"] += len(victims)
        return victims

    def stored_bytes(self) -> int:
        """The bytes of chunks the index holds (at most the cache's bound at every moment)."""
        return self._sql("SELECT COALESCE(SUM(size), 0) FROM chunks")[0][0]

    def prefetch(self, location: str, relatives: list[str], max_bytes: int) -> None:
        for relative in relatives:
            key = f"{store_key(location)}/{relative}"
            with self.flight_lock:
                if key in self.in_flight:
                    continue
                if self._sql("SELECT 1 FROM chunks WHERE key = ?", key):
                    continue
                self.in_flight[key] = self.pool.submit(self._prefetch_one, location, relative, key, max_bytes)

    def _prefetch_one(self, location: str, relative: str, key: str, max_bytes: int) -> None:
        try:
            if self._cached(key) is None:
                self._fetch(location, relative, key, max_bytes)
        finally:
            with self.flight_lock:
                self.in_flight.pop(key, None)

    def forget_chunks(self, prefix: str) -> None:
        self._sql("DELETE FROM chunks WHERE key LIKE ?", f"{prefix}/%")
        shutil.rmtree(self.directory / "chunks" / prefix, ignore_errors=True)


class ColdTokens:
    """The token array of one split of a cold store, read chunk by chunk through a ChunkCache (the store's
    zarr3 layout: chunk i of `chunk` tokens at `<split>/tokens/c/<i>`, bytes then zstd codecs)."""

    def __init__(self, cache: ChunkCache, location: str, split: str, mirror: Path):
        meta = json.loads((mirror / split / "tokens" / "zarr.json").read_text())
        codecs = [c["name"] for c in meta["codecs"]]
        if codecs != ["bytes", "zstd"] or meta["chunk_key_encoding"]["name"] != "default":
            raise ValueError(f"token store {location}: split {split!r} has codecs {codecs} / chunk keys "
                             f"{meta['chunk_key_encoding']}; the cache reads the layout jaxllm writes (bytes, zstd)")
        self.cache, self.location, self.split = cache, location, split
        self.dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        self.chunk = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        self._decoded: collections.OrderedDict | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_decoded"} | {"_decoded": None}

    def _relative(self, index: int) -> str:
        return f"{self.split}/tokens/c/{index}"

    def _chunk(self, index: int) -> np.ndarray:
        if self._decoded is None:
            self._decoded = collections.OrderedDict()
        if index in self._decoded:
            self._decoded.move_to_end(index)
            return self._decoded[index]
        raw = self.cache.read(self.location, self._relative(index))
        values = np.frombuffer(zstandard.ZstdDecompressor().decompress(
            raw, max_output_size=self.chunk * self.dtype.itemsize), self.dtype)
        self._decoded[index] = values
        while len(self._decoded) * self.chunk * self.dtype.itemsize > _DECODED_BYTES:
            self._decoded.popitem(last=False)
        return values

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int32."""
        pieces = [self._chunk(i)[max(start - i * self.chunk, 0):stop - i * self.chunk]
                  for i in range(start // self.chunk, (stop - 1) // self.chunk + 1)] if stop > start else []
        return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)

    def prefetch(self, ranges) -> None:
        """Fetch the chunks these token ranges lie in, in the background."""
        wanted = sorted({i for a, b in ranges if b > a for i in range(a // self.chunk, (b - 1) // self.chunk + 1)})
        self.cache.prefetch(self.location, [self._relative(i) for i in wanted])
