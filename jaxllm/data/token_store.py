"""Token store: tokenized documents on disk as tensorstore zarr3 arrays, one pair of arrays per split.

Layout of a store directory:

    manifest.json            format/version, vocab + special ids, tokenizer file, per-split stats, extra
    tokenizer.model          copy of the sentencepiece model the ids come from, or for a Hugging Face tokenizer
                             tokenizer.json (+ tokenizer_config.json, chat_template.jinja when the source had
                             them); the manifest's "tokenizer" names the file
    <split>/tokens/          1-D zarr3 array of token ids (uint16 if vocab <= 65535 else int32), zstd chunks
    <split>/doc_offsets/     1-D int64 zarr3 array, num_docs + 1 entries; doc i = tokens[off[i]:off[i+1]]

Stores are written to a temporary sibling directory and renamed into place, so a reader never sees half a
store. StoreSplit objects are picklable (grain worker processes receive them): tensorstore handles are
opened lazily in each process.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from jaxllm.data.cold_cache import ChunkCache, ColdTokens, is_url, normalize_location
from jaxllm.data.tokenizer import SENTENCEPIECE_FILE, tokenizer_files

FORMAT = "jaxllm.token_store"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = SENTENCEPIECE_FILE  # the name of a sentencepiece tokenizer in a store
TOKEN_CHUNK = 1 << 16
_OFFSET_CHUNK = 1 << 16
# Arrays are created with a huge shape and trimmed (metadata only) at the end, so documents can be
# streamed without knowing the total in advance; chunks past the end are never written.
_CAPACITY = 1 << 40
# In-memory cache of decoded chunks per process: repeated reads of nearby windows don't hit the disk.
_CACHE_BYTES = 64 << 20


def _array_spec(path: Path, dtype: str | None = None, chunk: int | None = None) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if dtype is not None:
        spec["metadata"] = {
            "shape": [_CAPACITY],
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "zstd", "configuration": {"level": 3}},
            ],
        }
    return spec


class _StreamWriter:
    """Appends 1-D data to a zarr3 array in whole chunks, then trims the shape to what was written."""

    def __init__(self, path: Path, dtype: str, chunk: int):
        self._arr = ts.open(_array_spec(path, dtype, chunk), create=True).result()
        self._np_dtype = np.dtype(dtype)
        self._chunk = chunk
        self._buf: list[np.ndarray] = []
        self._buffered = 0
        self._written = 0
        self._pending: list[ts.Future] = []

    def append(self, values: np.ndarray) -> None:
        self._buf.append(values)
        self._buffered += len(values)
        if self._buffered >= 4 * self._chunk:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        data = np.concatenate(self._buf) if self._buf else np.zeros(0, self._np_dtype)
        n = len(data) if final else (len(data) // self._chunk) * self._chunk
        if n:
            self._pending.append(self._arr[self._written:self._written + n].write(data[:n]))
            self._written += n
        self._buf = [data[n:]]
        self._buffered = len(data) - n
        if len(self._pending) > 8:  # bound the memory held by in-flight writes
            for f in self._pending:
                f.result()
            self._pending.clear()

    def close(self) -> int:
        self._flush(final=True)
        for f in self._pending:
            f.result()
        self._arr.resize(exclusive_max=[self._written], resize_metadata_only=True).result()
        return self._written


def write_token_store(
    path: str | os.PathLike,
    docs_by_split: dict[str, Iterable[Sequence[int] | np.ndarray]],
    *,
    tokenizer_path: str | os.PathLike,
    vocab_size: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    extra_manifest: dict | None = None,
) -> dict:
    """Write a token store atomically and return its manifest.

    Each document is stored exactly as given (callers pass [bos] + ids + [eos]). The store is built in
    `path.tmp-<pid>` and renamed to `path`. If `path` already exists it must be an empty directory or a
    store with an identical manifest (then this is a no-op); anything else raises FileExistsError.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)  # leftover of an earlier crash of this same pid
    tmp.mkdir(parents=True)
    try:
        dtype = "uint16" if vocab_size <= 65535 else "int32"
        splits = {}
        for name, docs in docs_by_split.items():
            tok_w = _StreamWriter(tmp / name / "tokens", dtype, TOKEN_CHUNK)
            off_w = _StreamWriter(tmp / name / "doc_offsets", "int64", _OFFSET_CHUNK)
            digest = hashlib.sha256()
            offset, num_docs = 0, 0
            off_w.append(np.zeros(1, np.int64))
            for doc in docs:
                arr = np.asarray(doc)
                if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() >= vocab_size)):
                    raise ValueError(f"split {name!r} document {num_docs}: expected 1-D ids in [0, {vocab_size})")
                arr = arr.astype(dtype)
                digest.update(arr.astype("<u4").tobytes())
                tok_w.append(arr)
                offset += len(arr)
                num_docs += 1
                off_w.append(np.array([offset], np.int64))
            num_tokens = tok_w.close()
            off_w.close()
            splits[name] = {"num_docs": num_docs, "num_tokens": num_tokens, "sha256": digest.hexdigest()}
        # The copy keeps the source's kind (tokenizer.model or tokenizer.json + its config files).
        files = tokenizer_files(tokenizer_path)
        for name, src in files.items():
            shutil.copyfile(src, tmp / name)
        # sha256 of the files joined by NUL: the file's own hash for sentencepiece, of model_proto for both kinds.
        tokenizer_sha256 = hashlib.sha256(b"\0".join(src.read_bytes() for src in files.values())).hexdigest()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "vocab_size": int(vocab_size),
            "bos_id": int(bos_id),
            "eos_id": int(eos_id),
            "pad_id": int(pad_id),
            "dtype": dtype,
            "tokenizer": next(iter(files)),
            "tokenizer_sha256": tokenizer_sha256,
            "splits": splits,
            "extra": dict(extra_manifest or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _commit(tmp, path, manifest)
        return manifest
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _commit(tmp: Path, path: Path, manifest: dict) -> None:
    if path.exists():
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        else:
            try:
                same = json.loads((path / MANIFEST).read_text()) == manifest
            except (OSError, ValueError):
                same = False
            if same:
                return
            raise FileExistsError(
                f"refusing to overwrite {path}: it exists and is not the token store being written "
                f"(remove it or choose another output directory)"
            )
    os.rename(tmp, path)


class StoreSplit:
    """One split of a token store: a concatenated token stream plus document offsets (held in memory). `cold`:
    the tokens of a store on a cold tier, read through the local cache (jaxllm/data/cold_cache.py)."""

    def __init__(self, root: Path, name: str, info: dict, cold: ColdTokens | None = None):
        self.root, self.name, self.cold = root, name, cold
        self.num_docs = int(info["num_docs"])
        self.num_tokens = int(info["num_tokens"])
        off_path = root / name / "doc_offsets"
        try:
            offsets = ts.open(_array_spec(off_path), open=True).result().read().result()
        except (ValueError, RuntimeError) as e:  # tensorstore reports missing/corrupt data as ValueError
            raise ValueError(f"token store {root}: cannot read {off_path} (expected a zarr3 int64 array): {e}") from None
        self.doc_offsets = np.asarray(offsets, np.int64)
        if (len(self.doc_offsets) != self.num_docs + 1 or self.doc_offsets[0] != 0
                or self.doc_offsets[-1] != self.num_tokens or np.any(np.diff(self.doc_offsets) < 0)):
            raise ValueError(
                f"token store {root}: {off_path} is inconsistent with the manifest "
                f"(expected {self.num_docs + 1} non-decreasing offsets from 0 to {self.num_tokens})"
            )
        self._tokens = None

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.doc_offsets)

    def _arr(self):
        if self._tokens is None:
            tok_path = self.root / self.name / "tokens"
            spec = _array_spec(tok_path)
            spec["context"] = {"cache_pool": {"total_bytes_limit": _CACHE_BYTES}}
            try:
                arr = ts.open(spec, open=True, read=True).result()
            except (ValueError, RuntimeError) as e:
                raise ValueError(f"token store {self.root}: cannot open {tok_path} (expected a zarr3 array): {e}") from None
            if arr.shape[0] != self.num_tokens:
                raise ValueError(f"token store {self.root}: {tok_path} has {arr.shape[0]} tokens, "
                                 f"manifest says {self.num_tokens}")
            self._tokens = arr
        return self._tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, as int32."""
        return self.read_many([(start, stop)])[0]

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Several reads issued concurrently (one round trip instead of len(ranges))."""
        for a, b in ranges:
            if not 0 <= a <= b <= self.num_tokens:
                raise IndexError(f"token range [{a}, {b}) outside [0, {self.num_tokens}) of split {self.name!r}")
        if self.cold is not None:
            return [self.cold.read(a, b) for a, b in ranges]
        arr = self._arr()
        futures = [arr[a:b].read() for a, b in ranges]
        return [np.asarray(f.result(), np.int32) for f in futures]

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Start bringing these token ranges of a cold store into the local cache (nothing for a local store)."""
        if self.cold is not None:
            self.cold.prefetch(ranges)

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document i (including its BOS/EOS)."""
        return self.read(int(self.doc_offsets[i]), int(self.doc_offsets[i + 1]))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"] = None  # tensorstore handles don't cross processes; reopen lazily
        return state


class TokenStore:
    """A token store directory opened for reading."""

    def __init__(self, root: Path, manifest: dict, cold: tuple[ChunkCache, str] | None = None):
        self.root = root
        self.manifest = manifest
        self.cold = cold  # (cache, location) of a store read through the local cache
        self._splits: dict[str, StoreSplit] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, cache: ChunkCache | None = None) -> "TokenStore":
        """Open and validate the manifest; raises FileNotFoundError / ValueError naming what is wrong.

        With `cache` (or for a URL, which needs one), the store is read through that local cache: its small
        files from the cache's mirror, its tokens chunk by chunk (jaxllm/data/cold_cache.py)."""
        if is_url(str(path)) and cache is None:
            raise ValueError(f"token store {path} is a URL: it is read through a local cache (data.cache_dir)")
        location = None
        if cache is not None:
            location = normalize_location(str(path))
            path = cache.mirror(location)
        root = Path(path)
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(
                f"no token store at {root}: expected {mpath} (build one with scripts/prepare_data.py)"
            )
        try:
            manifest = json.loads(mpath.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt token store manifest {mpath}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"{mpath} is not a token store manifest (expected \"format\": \"{FORMAT}\")")
        if manifest.get("version") != VERSION:
            raise ValueError(f"{mpath}: token store version {manifest.get('version')!r}, this code reads {VERSION}")
        missing = [k for k in ("vocab_size", "bos_id", "eos_id", "pad_id", "splits", "tokenizer") if k not in manifest]
        if missing:
            raise ValueError(f"corrupt token store manifest {mpath}: missing keys {missing}")
        return cls(root, manifest, (cache, location) if cache is not None else None)

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest["tokenizer"]

    @property
    def split_names(self) -> list[str]:
        return list(self.manifest["splits"])

    def split(self, name: str) -> StoreSplit:
        """The named split (offsets loaded on first access)."""
        if name not in self.manifest["splits"]:
            raise ValueError(f"token store {self.root} has no split {name!r} (it has {self.split_names})")
        if name not in self._splits:
            cold = ColdTokens(self.cold[0], self.cold[1], name, self.root) if self.cold is not None else None
            self._splits[name] = StoreSplit(self.root, name, self.manifest["splits"][name], cold)
        return self._splits[name]
