"""Resumable stage directories: a stage's output is built in a temporary sibling and renamed into place.

    <root>/stages/<name>/stage.json      the stage's manifest section, including its fingerprint
    <root>/stages/<name>/part-*.jsonl.gz its documents ({"id", "text"} per line), for the next stage

A stage whose stage.json carries the expected fingerprint (a hash of its inputs and config) is complete and
skipped; anything else is rebuilt from scratch. Because the rename is the commit, an interrupted run leaves
either the old complete stage or none, never a half-written one.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

STAGE_FILE = "stage.json"
SHARD_DOCS = 20_000


def fingerprint(obj) -> str:
    """sha256 of a JSON-serialisable object (keys sorted): equal inputs + config = equal fingerprint."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to path via a temporary file and a rename (readers see the old or the new file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_stage(stage_dir: Path, expected_fingerprint: str) -> dict | None:
    """The stage's recorded section if it is complete for this fingerprint, else None."""
    try:
        info = json.loads((stage_dir / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("fingerprint") == expected_fingerprint else None


def run_stage(stages_root: Path, name: str, stage_fingerprint: str,
              build: Callable[[Path], dict]) -> tuple[dict, bool]:
    """(section, skipped): run `build(tmp_dir) -> stats` unless the stage is already complete.

    The section recorded is the stats plus fingerprint, wall time and MB/s (from stats["bytes_in"]).
    """
    final = stages_root / name
    done = read_stage(final, stage_fingerprint)
    if done is not None:
        return done, True
    for stale in stages_root.glob(f".{name}.tmp-*"):  # left by an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    tmp = stages_root / f".{name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        stats = build(tmp)
        seconds = time.perf_counter() - t0
        section = {"fingerprint": stage_fingerprint, **stats, "seconds": round(seconds, 3),
                   "mb_per_s": round(stats.get("bytes_in", 0) / 1e6 / max(seconds, 1e-9), 3)}
        write_json_atomic(tmp / STAGE_FILE, section)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return section, False


class ShardWriter:
    """Writes {"id", "text"} records to part-NNNNN.jsonl.gz files of at most SHARD_DOCS documents."""

    def __init__(self, directory: Path):
        self.dir, self.count, self.bytes, self._f, self._n = directory, 0, 0, None, 0

    def write(self, doc_id: str, text: str) -> None:
        if self._f is None or self._n >= SHARD_DOCS:
            self._close_file()
            # Level 1: these files are intermediate; speed matters more than size.
            self._f = gzip.open(self.dir / f"part-{self.count // SHARD_DOCS:05d}.jsonl.gz", "wt",
                                encoding="utf-8", compresslevel=1)
            self._n = 0
        self._f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
        self.count += 1
        self._n += 1
        self.bytes += len(text.encode("utf-8"))

    def _close_file(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def close(self) -> None:
        self._close_file()


def write_shards(directory: Path, records: Iterable[tuple[str, str]]) -> tuple[int, int]:
    """(documents, text bytes) written."""
    w = ShardWriter(directory)
    try:
        for doc_id, text in records:
            w.write(doc_id, text)
    finally:
        w.close()
    return w.count, w.bytes


def read_shards(directory: Path) -> Iterator[tuple[str, str]]:
    """(id, text) of every record of a stage directory, in order."""
    for part in sorted(directory.glob("part-*.jsonl.gz")):
        with gzip.open(part, "rt", encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                yield rec["id"], rec["text"]
