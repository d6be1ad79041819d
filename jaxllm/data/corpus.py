"""Raw-text readers: .jsonl / .jsonl.gz (one document per line, field `text`) and .txt (one document per file).

Directories are walked recursively in sorted order, so the document order is a pure function of the inputs.
Errors name the file (and line) and what was expected.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")


def _is_corpus_file(p: Path) -> bool:
    return p.name.endswith(SUFFIXES)


def list_input_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand input paths (files or directories) into a sorted, de-duplicated list of corpus files."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and _is_corpus_file(q))
            if not found:
                raise FileNotFoundError(f"input directory {p} holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif p.is_file():
            if not _is_corpus_file(p):
                raise ValueError(f"input {p}: unsupported file type (expected {', '.join(SUFFIXES)})")
            files.append(p)
        else:
            raise FileNotFoundError(f"input path {p} does not exist (expected a {'/'.join(SUFFIXES)} file or a directory)")
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


def read_jsonl(path: Path) -> Iterator[str]:
    """The `text` field of every non-blank line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field \"text\"")
                yield rec["text"]
    except (OSError, EOFError, UnicodeDecodeError) as e:  # bad gzip / bad encoding
        raise ValueError(f"{path}: cannot read as {'gzipped ' if opener is gzip.open else ''}UTF-8 JSON lines ({e})") from None


def read_txt(path: Path) -> Iterator[str]:
    """The whole file as one document (bytes decoded as UTF-8, newlines kept exactly)."""
    try:
        yield path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def read_documents(files: Iterable[Path]) -> Iterator[str]:
    """All documents of all files, in order."""
    for f in files:
        yield from (read_txt(f) if f.name.endswith(".txt") else read_jsonl(f))


def fingerprint_files(files: Iterable[Path]) -> str:
    """sha256 over the names and contents of the files: what 'same inputs' means for re-runs."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()
