"""Raw-text readers: plain text, JSON lines (field `text`) and Parquet (column `text`), optionally gzip/zstd.

File types, by name: `.txt`/`.text` (one document per file, or blank-line separated documents), `.jsonl`
(one JSON object per line), `.parquet`; text and JSON lines may end in `.gz`, `.zst` or `.zstd`.
Directories are walked recursively in sorted order, so document order is a pure function of the inputs.

Bad input never raises: a file that cannot be read (unsupported type, unreadable, corrupt compression,
empty, binary, not UTF-8) is skipped and reported with its path and reason; a bad record inside a good file
(not JSON, no string `text`) is dropped and counted; a few invalid UTF-8 bytes in a document are replaced by
U+FFFD and the document counted as repaired. Only a missing input path is an error (FileNotFoundError).
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

_TEXT_EXT = (".txt", ".text")
_COMPRESSION = ("", ".gz", ".zst", ".zstd")
SUFFIXES = tuple(e + c for e in (*_TEXT_EXT, ".jsonl") for c in _COMPRESSION) + (".parquet",)
_SNIFF = 8192
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n[\s]*")


def _is_corpus_file(p: Path) -> bool:
    return p.name.lower().endswith(SUFFIXES)


def list_input_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand input paths (files or directories) into a sorted, de-duplicated list of files.

    Directories contribute their corpus files (hidden files and unknown extensions ignored); a file named
    explicitly is kept whatever its type (the reader then skips it with a reason if it cannot read it).
    Raises FileNotFoundError naming the first path that does not exist.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*") if q.is_file() and _is_corpus_file(q)
                                and not any(part.startswith(".") for part in q.relative_to(p).parts)))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"input path {p} does not exist (expected a file or a directory)")
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


@dataclass
class ReadStats:
    """What reading saw: bytes, documents, skipped files (path, reason), dropped records, repairs."""

    files_read: int = 0
    bytes_in: int = 0  # decompressed bytes of the files read
    docs: int = 0
    repaired_docs: int = 0
    skipped_files: list[dict] = field(default_factory=list)
    dropped: collections.Counter = field(default_factory=collections.Counter)

    def to_dict(self) -> dict:
        return {"files_read": self.files_read, "bytes_in": self.bytes_in, "docs": self.docs,
                "repaired_docs": self.repaired_docs, "skipped_files": self.skipped_files,
                "dropped": dict(sorted(self.dropped.items()))}


class _Skip(Exception):
    """Raised inside a reader: skip the whole file with this reason."""


def _open_binary(path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise _Skip("zstd-compressed, and the zstandard package is not installed") from None
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _decode(data: bytes, max_bad_fraction: float) -> tuple[str | None, bool]:
    """(text, repaired): text None when more than max_bad_fraction of the characters were invalid bytes."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        pass
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count(b"\xef\xbf\xbd")  # U+FFFD already present is not a repair
    if bad > max_bad_fraction * max(len(text), 1):
        return None, True
    return text, True


def _check_start(head: bytes) -> None:
    if not head.strip():
        raise _Skip("empty")
    if b"\0" in head[:_SNIFF]:
        raise _Skip("binary (holds NUL bytes; UTF-16 or not text)")


def _read_all(path: Path) -> bytes:
    with _open_binary(path) as f:
        return f.read()


def _text_docs(path: Path, split: str, max_bad: float, stats: ReadStats) -> Iterator[str]:
    data = _read_all(path)
    _check_start(data[:_SNIFF] if data.strip() else b"")
    text, repaired = _decode(data, max_bad)
    if text is None:
        raise _Skip("not UTF-8 text")
    stats.bytes_in += len(data)
    stats.files_read += 1
    docs = [text] if split == "file" else [d for d in _BLANK_LINES.split(text) if d.strip()]
    for d in docs:
        stats.repaired_docs += repaired and "\ufffd" in d
        yield d


def _jsonl_docs(path: Path, max_bad: float, stats: ReadStats) -> Iterator[str]:
    data = _read_all(path)
    _check_start(data[:_SNIFF] if data.strip() else b"")
    # A file that is mostly not UTF-8 is skipped as a whole; a few bad bytes are repaired per record.
    if _decode(data, max_bad)[0] is None:
        raise _Skip("not UTF-8 text")
    stats.bytes_in += len(data)
    stats.files_read += 1
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        text, repaired = _decode(line, max_bad)
        if text is None:
            stats.dropped["invalid_utf8"] += 1
            continue
        try:
            rec = json.loads(text)
        except ValueError:
            stats.dropped["malformed_record"] += 1
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            stats.dropped["malformed_record"] += 1
            continue
        doc = rec["text"]
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
            doc = doc.encode("utf-8", errors="replace").decode("utf-8")
            repaired = True
        stats.repaired_docs += repaired
        yield doc


def _parquet_docs(path: Path, max_bad: float, stats: ReadStats) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _Skip("Parquet, and the pyarrow package is not installed") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt or non-Parquet files
        raise _Skip(f"not a readable Parquet file ({type(e).__name__})") from None
    if "text" not in pf.schema_arrow.names:
        raise _Skip(f"Parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
    if pf.metadata.num_rows == 0:
        raise _Skip("empty")
    stats.files_read += 1
    for batch in pf.iter_batches(columns=["text"], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if isinstance(value, bytes):
                value, repaired = _decode(value, max_bad)
                if value is None:
                    stats.dropped["invalid_utf8"] += 1
                    continue
                stats.repaired_docs += repaired
            if not isinstance(value, str):
                stats.dropped["malformed_record"] += 1
                continue
            stats.bytes_in += len(value.encode("utf-8", errors="replace"))
            yield value


def iter_documents(files: Iterable[Path], stats: ReadStats, *, txt_split: str = "file",
                   max_invalid_utf8_fraction: float = 0.01) -> Iterator[tuple[str, str]]:
    """(doc_id, text) of every readable document, in file order; doc_id is 'path:index'.

    Skipped files and dropped records are recorded in `stats`; nothing raises for bad content.
    """
    for path in files:
        name = path.name.lower()
        if name.endswith(".parquet"):
            reader = _parquet_docs(path, max_invalid_utf8_fraction, stats)
        elif name.endswith(tuple(".jsonl" + c for c in _COMPRESSION)):
            reader = _jsonl_docs(path, max_invalid_utf8_fraction, stats)
        elif name.endswith(tuple(e + c for e in _TEXT_EXT for c in _COMPRESSION)):
            reader = _text_docs(path, txt_split, max_invalid_utf8_fraction, stats)
        else:
            stats.skipped_files.append({"path": str(path), "reason": f"unsupported file type (expected {', '.join(SUFFIXES)})"})
            continue
        i = 0
        try:
            for text in reader:
                stats.docs += 1
                yield f"{path}:{i}", text
                i += 1
        except _Skip as e:
            stats.skipped_files.append({"path": str(path), "reason": str(e)})
        except (OSError, EOFError, ValueError, RuntimeError) as e:  # unreadable, corrupt gzip/zstd, ...
            # Documents already yielded from this file stay (a truncated archive keeps its readable part).
            stats.skipped_files.append({"path": str(path), "reason": f"unreadable after {i} documents: {type(e).__name__}: {e}"})


def file_sha256(path: Path) -> str:
    """Content hash of one file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_inputs(files: Iterable[Path]) -> list[dict]:
    """[{path, bytes, sha256}] of each input file: what 'same inputs' means for re-runs."""
    out = []
    for f in files:
        try:
            out.append({"path": str(f), "bytes": f.stat().st_size, "sha256": file_sha256(f)})
        except OSError as e:  # unreadable: still part of the identity of the inputs (the reader will skip it)
            out.append({"path": str(f), "bytes": None, "sha256": None, "error": type(e).__name__})
    return out


def fingerprint_files(files: Iterable[Path]) -> str:
    """sha256 over the names and content hashes of the files."""
    h = hashlib.sha256()
    for d in describe_inputs(files):
        h.update(f"{Path(d['path']).name}\0{d['sha256']}\0".encode())
    return h.hexdigest()
