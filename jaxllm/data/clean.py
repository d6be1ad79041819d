"""Stage 1 rules: text normalisation and document quality filters (Gopher-style), as pure functions.

`normalize(text)` is applied to every document; `quality_reason(text, cfg)` returns the name of the first
filter a normalised document fails (None if it passes). The names are the `dropped` keys of the manifest.
"""
from __future__ import annotations

import re
import unicodedata

import numpy as np

from jaxllm.data.prep_config import CleanConfig

# Unicode space separators (NBSP, thin spaces, ideographic space, ...) and other odd whitespace -> ' '.
_SPACES = re.compile(r"[\t\x0b\x0c\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
# C0/C1 controls except \n, zero-width characters and the BOM: invisible, and they only fragment tokens.
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]")
_TRAILING = re.compile(r"[ ]+\n")
_MANY_BLANK = re.compile(r"\n{3,}")
_WORD = re.compile(r"\S+")
_ALPHA_WORD = re.compile(r"(?<!\S)\S*?[^\W\d_]\S*")  # a whitespace-separated word holding a letter
_SYMBOL_CHAR = re.compile(r"[^\w\s]|_")
_BULLET = re.compile(r"^\s*[-*\u2022\u2023\u25e6\u2043\u2219\u25aa\u25cf\u2013]\s")
_NGRAM_WORD = re.compile(r"\w+")

# Common English function words (a short list on purpose: the ratio, not the vocabulary, is the signal).
EN_STOPWORDS = frozenset("""
a about after all also an and any are as at be been but by can could did do does for from had has have he
her him his how i if in into is it its me more my no not now of on one only or our out over said she so some
than that the their them then there these they this those to up us was we were what when which who will with
would you your thee thou thy thine hath doth art shall
""".split())


def normalize(text: str) -> str:
    """NFC; CRLF/CR -> LF; tabs and Unicode spaces -> ' '; controls and zero-width characters removed;
    trailing spaces stripped; runs of blank lines collapsed to one; no leading/trailing blank lines.

    Leading indentation is kept (verse and code use it).
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n\n")
    text = _SPACES.sub(" ", text)
    text = _CONTROL.sub("", text)
    text = _TRAILING.sub("\n", text)
    text = _MANY_BLANK.sub("\n\n", text)
    return text.strip("\n").rstrip(" ")


def _dup_fraction(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier item, fraction of characters in those repeats)."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_n = dup_chars = total_chars = 0
    for it in items:
        total_chars += len(it)
        if it in seen:
            dup_n += 1
            dup_chars += len(it)
        else:
            seen.add(it)
    return dup_n / len(items), dup_chars / max(total_chars, 1)


# Odd 64-bit multipliers for hashing word n-grams (wrapping uint64 arithmetic; collisions ~2^-64).
_GRAM_MULT = np.random.default_rng(20240601).integers(1, 2**63, size=10, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _gram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    m = len(ids) - n + 1
    h = np.zeros(max(m, 0), np.uint64)
    for k in range(n):
        h += ids[k:k + m] * _GRAM_MULT[k]
    return h


def ngram_char_fractions(docs_words: list[list[str]], top_ns=(2, 3, 4), dup_ns=range(5, 11),
                         chunk_words: int = 1 << 17) -> dict[str, np.ndarray]:
    """_ngram_char_fractions over chunks of about chunk_words words (sorts that fit in cache are faster)."""
    parts, start, words = [], 0, 0
    for i, ws in enumerate(docs_words):
        words += len(ws)
        if words >= chunk_words or i == len(docs_words) - 1:
            parts.append(_ngram_char_fractions(docs_words[start:i + 1], top_ns, dup_ns))
            start, words = i + 1, 0
    keys = [f"top_{n}gram" for n in top_ns] + [f"dup_{n}gram" for n in dup_ns]
    return {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in keys}


def _ngram_char_fractions(docs_words: list[list[str]], top_ns=(2, 3, 4), dup_ns=range(5, 11)) -> dict[str, np.ndarray]:
    """Gopher's repetition statistics of many documents at once (lists of lowercased words), with numpy.

    top_n[d]: characters covered by the occurrences of document d's top n-gram / characters of its words; the
      top n-gram is the repeated one covering the most characters (count x length; Gopher picks by count,
      which only differs on ties and gives a value no larger).
    dup_n[d]: characters of words inside any n-gram occurring more than once in d / characters of its words
      (each word counted once even if several duplicated n-grams cover it).
    All documents are processed in one sort per n (n-grams hashed together with their document index), which
    is what makes this fast: per-document numpy calls would cost more than the arithmetic.
    """
    D = len(docs_words)
    out = {f"top_{n}gram": np.zeros(D) for n in top_ns} | {f"dup_{n}gram": np.zeros(D) for n in dup_ns}
    sizes = np.fromiter(map(len, docs_words), np.int64, D)
    W = int(sizes.sum())
    if W == 0:
        return out
    flat = [w for ws in docs_words for w in ws]
    # Python's str hash is salted per process, but only equality matters here: results do not depend on it.
    ids = np.fromiter(map(hash, flat), np.int64, W).view(np.uint64)
    lens = np.fromiter(map(len, flat), np.int64, W)
    doc = np.repeat(np.arange(D), sizes)
    doc_start = np.concatenate([[0], np.cumsum(sizes)])
    totals = np.maximum(np.bincount(doc, weights=lens, minlength=D), 1)
    cum = np.concatenate([[0], np.cumsum(lens)])
    pos_in_doc = np.arange(W) - doc_start[doc]
    salt = doc.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for n in (*top_ns, *dup_ns):
        m = W - n + 1
        if m <= 0:
            continue
        valid = pos_in_doc[:m] + n <= sizes[doc[:m]]  # n-grams that do not cross a document boundary
        h = _gram_hashes(ids, n) ^ salt[:m]
        idx = np.flatnonzero(valid)
        order = idx[np.argsort(h[idx])]
        sh = h[order]
        eq = sh[1:] == sh[:-1]
        if not eq.any():
            continue
        if n in top_ns:
            run_starts = np.flatnonzero(np.concatenate([[True], ~eq]))
            runs = np.diff(np.append(run_starts, len(sh)))
            first = order[run_starts]
            keep = runs > 1
            chars = runs[keep] * (cum[first[keep] + n] - cum[first[keep]])
            best = np.zeros(D)
            np.maximum.at(best, doc[first[keep]], chars)
            out[f"top_{n}gram"] = best / totals
        else:
            dup_sorted = np.zeros(len(sh), bool)
            dup_sorted[1:] |= eq
            dup_sorted[:-1] |= eq
            starts = np.zeros(W, np.int64)
            starts[order[dup_sorted]] = 1
            # Word j is covered if a duplicated n-gram of its document starts in [j - n + 1, j].
            c = np.concatenate([[0], np.cumsum(starts)])
            j = np.arange(W)
            lo = np.maximum(j - n + 1, doc_start[doc])
            covered = (c[j + 1] - c[lo]) > 0
            out[f"dup_{n}gram"] = np.bincount(doc, weights=lens * covered, minlength=D) / totals
    return out


def _simple_reason(text: str, cfg: CleanConfig) -> str | None:
    """The per-document rules (everything but the n-gram repetition and language rules)."""
    n_chars = len(text)
    if cfg.min_chars is not None and n_chars < cfg.min_chars:
        return "too_short_chars"
    if cfg.max_chars is not None and n_chars > cfg.max_chars:
        return "too_long_chars"
    words = _WORD.findall(text)
    n = len(words)
    if cfg.min_words is not None and n < cfg.min_words:
        return "too_few_words"
    if cfg.max_words is not None and n > cfg.max_words:
        return "too_many_words"
    if n == 0:
        return "no_words"
    mean_len = sum(map(len, words)) / n
    if cfg.min_mean_word_len is not None and mean_len < cfg.min_mean_word_len:
        return "mean_word_length"
    if cfg.max_mean_word_len is not None and mean_len > cfg.max_mean_word_len:
        return "mean_word_length"
    if cfg.min_alpha_word_fraction is not None:
        if len(_ALPHA_WORD.findall(text)) / n < cfg.min_alpha_word_fraction:
            return "alpha_words"
    if cfg.min_alnum_space_fraction is not None:
        if 1.0 - len(_SYMBOL_CHAR.findall(text)) / n_chars < cfg.min_alnum_space_fraction:
            return "symbol_chars"
    if cfg.max_symbol_word_ratio is not None:
        symbols = text.count("#") + text.count("...") + text.count("\u2026")
        if symbols / n > cfg.max_symbol_word_ratio:
            return "symbol_word_ratio"
    lines = [ln.strip() for ln in text.split("\n")]
    lines = [ln for ln in lines if ln]
    if lines:
        if cfg.max_bullet_line_fraction is not None:
            if sum(1 for ln in lines if _BULLET.match(ln)) / len(lines) > cfg.max_bullet_line_fraction:
                return "bullet_lines"
        if cfg.max_ellipsis_line_fraction is not None:
            ends = sum(1 for ln in lines if ln.endswith(("...", "\u2026")))
            if ends / len(lines) > cfg.max_ellipsis_line_fraction:
                return "ellipsis_lines"
        frac, char_frac = _dup_fraction(lines)
        if cfg.max_dup_line_fraction is not None and frac > cfg.max_dup_line_fraction:
            return "dup_lines"
        if cfg.max_dup_line_char_fraction is not None and char_frac > cfg.max_dup_line_char_fraction:
            return "dup_line_chars"
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    frac, char_frac = _dup_fraction(paras)
    if cfg.max_dup_para_fraction is not None and frac > cfg.max_dup_para_fraction:
        return "dup_paragraphs"
    if cfg.max_dup_para_char_fraction is not None and char_frac > cfg.max_dup_para_char_fraction:
        return "dup_paragraph_chars"
    return None


def quality_reasons(texts: list[str], cfg: CleanConfig) -> list[str | None]:
    """For each normalised text, the first filter it fails (the `dropped` key of the manifest), or None.

    Order: length, word statistics, symbols, line/paragraph repetition (per document), then the n-gram
    repetition and language rules (batched over the documents still passing).
    """
    if not cfg.filters:
        return [None] * len(texts)
    reasons = [_simple_reason(t, cfg) for t in texts]
    todo = [i for i, r in enumerate(reasons) if r is None]
    tops = cfg.max_top_ngram_char_fraction or ()
    dups = cfg.max_dup_ngram_char_fraction or ()
    if not todo or not (tops or dups or cfg.language):
        return reasons
    words = [_NGRAM_WORD.findall(texts[i].lower()) for i in todo]
    fr = ngram_char_fractions(words, (2, 3, 4)[:len(tops)], range(5, 5 + len(dups))) if tops or dups else {}
    for k, i in enumerate(todo):
        for n, limit in zip((2, 3, 4), tops):
            if fr[f"top_{n}gram"][k] > limit:
                reasons[i] = f"top_{n}gram"
                break
        else:
            for n, limit in zip(range(5, 11), dups):
                if fr[f"dup_{n}gram"][k] > limit:
                    reasons[i] = f"dup_{n}gram"
                    break
        if reasons[i] is None and cfg.language == "en" and words[k]:
            if sum(1 for w in words[k] if w in EN_STOPWORDS) / len(words[k]) < cfg.min_stopword_ratio:
                reasons[i] = "language"
    return reasons


def quality_reason(text: str, cfg: CleanConfig) -> str | None:
    """quality_reasons() of one document."""
    return quality_reasons([text], cfg)[0]


def clean_documents(texts: list[str], cfg: CleanConfig) -> list[tuple[str, str | None]]:
    """(normalised text, reason it is dropped or None) for each raw text."""
    norm = [normalize(t) for t in texts]
    reasons = quality_reasons(norm, cfg)
    return [(t, "empty_after_normalize" if not t.strip() else r) for t, r in zip(norm, reasons)]


def clean_document(text: str, cfg: CleanConfig) -> tuple[str, str | None]:
    """clean_documents() of one document."""
    return clean_documents([text], cfg)[0]
