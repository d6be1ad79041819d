"""Thresholds of the preparation stages: frozen dataclasses with defaults, JSON files and CLI overrides.

    cfg = PrepConfig()                                            # the defaults below
    cfg = load_config("my_data.json", ["clean.min_words=20"])     # JSON file, then `section.field=value`s

The JSON file holds any subset of the sections, e.g. {"clean": {"min_words": 20}, "dedup": {"threshold": 0.7}}.
Unknown sections or fields are errors (a typo must not silently keep a default). Every field that changes
what a stage produces is part of that stage's fingerprint, so changing it re-runs the stage.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field


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


class ConfigError(ValueError):
    """A bad config file or override (message names the key and what is expected)."""


def _coerce(name: str, tp, value):
    """Convert a JSON value or CLI string to the field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, inner[0], value)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list of numbers, got {value!r}")
        return tuple(_coerce(name, args[0], v) for v in value)
    try:
        if tp is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {value!r}") from None
    raise ConfigError(f"{name}: unsupported field type {tp}")


def _with_updates(cfg: PrepConfig, updates: dict[str, dict]) -> PrepConfig:
    sections = {f.name: f for f in dataclasses.fields(PrepConfig)}
    new = {}
    for sec, values in updates.items():
        if sec not in sections:
            raise ConfigError(f"unknown config section {sec!r} (expected one of {sorted(sections)})")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {sec!r}: expected an object of field values")
        current = new.get(sec, getattr(cfg, sec))
        hints = typing.get_type_hints(type(current))
        fields = {f.name for f in dataclasses.fields(current)}
        changes = {}
        for k, v in values.items():
            if k not in fields:
                raise ConfigError(f"unknown config field {sec}.{k} (fields of {sec}: {', '.join(sorted(fields))})")
            changes[k] = _coerce(f"{sec}.{k}", hints[k], v)
        new[sec] = dataclasses.replace(current, **changes)
    cfg = dataclasses.replace(cfg, **new)
    _validate(cfg)
    return cfg


def _validate(cfg: PrepConfig) -> None:
    if cfg.read.txt_split not in ("file", "blank_lines"):
        raise ConfigError(f"read.txt_split: expected 'file' or 'blank_lines', got {cfg.read.txt_split!r}")
    if cfg.clean.language not in (None, "en"):
        raise ConfigError(f"clean.language: expected none or 'en', got {cfg.clean.language!r}")
    d = cfg.dedup
    if d.num_perm < 1 or d.bands < 1 or d.num_perm % d.bands:
        raise ConfigError(f"dedup.num_perm ({d.num_perm}) must be a positive multiple of dedup.bands ({d.bands})")
    if not 0.0 < d.threshold <= 1.0:
        raise ConfigError(f"dedup.threshold must be in (0, 1], got {d.threshold}")
    if d.ngram < 1:
        raise ConfigError(f"dedup.ngram must be >= 1, got {d.ngram}")


def parse_overrides(overrides: list[str]) -> dict[str, dict]:
    """['clean.min_words=20', ...] -> {'clean': {'min_words': '20'}} (values coerced later)."""
    out: dict[str, dict] = {}
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        sec, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"bad override {item!r}: expected --section.field=value, e.g. --clean.min_words=20")
        out.setdefault(sec, {})[name] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> PrepConfig:
    """Defaults, then the JSON file (if any), then `section.field=value` overrides. Raises ConfigError."""
    cfg = PrepConfig()
    if path is not None:
        try:
            data = json.loads(open(path, encoding="utf-8").read())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read data config {path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"data config {path}: expected a JSON object of sections")
        cfg = _with_updates(cfg, data)
    return _with_updates(cfg, parse_overrides(list(overrides)))
