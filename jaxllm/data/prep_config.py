"""Thresholds of the preparation stages: frozen dataclasses with defaults, JSON files and CLI overrides.

    cfg = PrepConfig()                                                # the defaults below
    cfg = load_config("my_data.json", [("clean.min_words", "20")])    # JSON file, then `section.field` overrides

The JSON file holds any subset of the sections, e.g. {"clean": {"min_words": 20}, "dedup": {"threshold": 0.7}}.
Unknown sections or fields are errors (a typo must not silently keep a default); values are parsed and errors
worded as for the training config, by jaxllm/config/typed_config.py. Every field that changes
what a stage produces is part of that stage's fingerprint, so changing it re-runs the stage.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxllm.config.typed_config import ConfigError, build, set_value


@dataclass(frozen=True)
class ReadConfig:
    """How raw files become documents."""

    # "file": a .txt file is one document; "blank_lines": documents are separated by blank lines.
    txt_split: str = "file"


@dataclass(frozen=True)
class CleanConfig:
    """Normalisation is always on; each filter is off when its threshold is None.

    The repetition and word-statistics rules follow Gopher (Rae et al. 2021, appendix A). Two defaults are
    looser than the paper's, measured on the shipped Shakespeare corpus (plays have a speaker-name line before
    every speech, so 'ROMEO.' recurs dozens of times per scene): duplicated-line fraction 0.45 (paper 0.30)
    and duplicated-line character fraction 0.25 (paper 0.20). With these defaults no Shakespeare document is
    dropped by the line rules; 3 of 1,306 are dropped by the n-gram repetition rules (scenes built on a repeated refrain,
    e.g. "And I for Ganymede. / And I for Rosalind." in As You Like It V.2), which is what those rules are for.
    """

    # False: only normalise (every filter below off).
    filters: bool = True
    min_chars: int | None = 100
    max_chars: int | None = 1_000_000
    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_len: float | None = 3.0
    max_mean_word_len: float | None = 10.0
    # Fraction of words holding at least one alphabetic character (Gopher: 0.8).
    min_alpha_word_fraction: float | None = 0.8
    # Fraction of characters that are letters, digits or whitespace: catches markup/binary-ish junk.
    min_alnum_space_fraction: float | None = 0.7
    # ('#' + '...' + '…') per word (Gopher: 0.1).
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_line_fraction: float | None = 0.9
    max_ellipsis_line_fraction: float | None = 0.3
    max_dup_line_fraction: float | None = 0.45
    max_dup_line_char_fraction: float | None = 0.25
    max_dup_para_fraction: float | None = 0.3
    max_dup_para_char_fraction: float | None = 0.2
    # Characters covered by the most frequent n-gram, for n = 2, 3, 4 (Gopher: 0.20, 0.18, 0.16).
    max_top_ngram_char_fraction: tuple[float, ...] | None = (0.20, 0.18, 0.16)
    # Characters covered by duplicated n-grams, for n = 5 .. 10 (Gopher: 0.15 .. 0.10).
    max_dup_ngram_char_fraction: tuple[float, ...] | None = (0.15, 0.14, 0.13, 0.12, 0.11, 0.10)
    # Language filter: None (off) or "en". English is a stop-word heuristic: at least min_stopword_ratio of
    # the words must be common English function words (typical English prose: 0.4-0.5; other languages
    # written in Latin script: < 0.05).
    language: str | None = None
    min_stopword_ratio: float = 0.15
    # Documents whose undecodable bytes exceed this fraction of their characters are dropped rather than
    # repaired (each bad byte becomes U+FFFD when repaired).
    max_invalid_utf8_fraction: float = 0.01


@dataclass(frozen=True)
class DedupConfig:
    """Exact (hash of the cleaned text) and near-duplicate (MinHash + LSH) removal."""

    exact: bool = True
    near: bool = True
    # Word n-gram shingles (lowercased words of letters/digits).
    ngram: int = 5
    num_perm: int = 128
    # LSH: num_perm = bands * rows. Pairs sharing a band are candidates, kept as duplicates only if their
    # estimated Jaccard similarity (signature agreement) is >= threshold.
    bands: int = 16
    threshold: float = 0.8
    seed: int = 1


@dataclass(frozen=True)
class PrepConfig:
    read: ReadConfig = field(default_factory=ReadConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _validate(cfg: PrepConfig) -> None:
    if cfg.read.txt_split not in ("file", "blank_lines"):
        raise ConfigError("read.txt_split", f"expected 'file' or 'blank_lines', got {cfg.read.txt_split!r}")
    if cfg.clean.language not in (None, "en"):
        raise ConfigError("clean.language", f"expected none or 'en', got {cfg.clean.language!r}")
    d = cfg.dedup
    if d.num_perm < 1 or d.bands < 1 or d.num_perm % d.bands:
        raise ConfigError("dedup.num_perm", f"{d.num_perm} must be a positive multiple of dedup.bands={d.bands}")
    if not 0.0 < d.threshold <= 1.0:
        raise ConfigError("dedup.threshold", f"must be in (0, 1], got {d.threshold}")
    if d.ngram < 1:
        raise ConfigError("dedup.ngram", f"must be >= 1, got {d.ngram}")


def _read_json(path: str | os.PathLike) -> dict:
    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise ConfigError(str(path), f"cannot read data config: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(str(path), f"data config is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "expected a JSON object of sections, e.g. {\"clean\": {\"min_words\": 20}}")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[tuple[str, str]] = ()) -> PrepConfig:
    """Defaults, then the JSON file (if any), then `(section.field, text)` overrides (jaxllm.config.cli.split_overrides
    of `--section.field=value` arguments), through the training config's path (jaxllm/config/typed_config.py): the same
    coercion, key checks and ConfigError. Raises ConfigError."""
    tree = build(PrepConfig, _read_json(path) if path is not None else {}).to_dict()
    for key, text in overrides:
        set_value(tree, key, text, PrepConfig)
    cfg = build(PrepConfig, tree)
    _validate(cfg)
    return cfg
