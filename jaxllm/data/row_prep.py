"""What SFT and preference data preparation share: reading JSON lines with bad records counted and skipped, a
seeded held-out split, a fingerprint of the inputs and settings, an atomic commit into `data.path`, and reading
the packed rows back.

A prepared directory holds `manifest.json` (written last; its "format" names the kind of data) and
`{train,eval}/<field>.npy`, int32 [rows, seq_len] for each of tokens, targets, loss_mask, segment_ids, positions,
plus whatever the kind of data adds. Preparing again with the same inputs and settings is skipped; different ones
into the same directory is an error (PreparedDataError), never an overwrite.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from jaxllm.data.pipeline import FIELDS
from jaxllm.data.prepare import split_train_eval
from jaxllm.data.tokenizer import tokenizer_files

MANIFEST = "manifest.json"
MAX_REPORTED_LINES = 20  # skipped lines listed in the manifest (all are counted)


class PreparedDataError(ValueError):
    """A problem with fine-tuning inputs or the prepared directory, as one line naming the file; `key` is the
    setting that names it."""

    def __init__(self, message: str, key: str = "data.path"):
        super().__init__(message)
        self.key = key


def read_records(path: Path, skipped: list[dict], parse: Callable) -> Iterator:
    """`parse(record)` of every usable line of `path`; each line that is not JSON or that `parse` rejects (with a
    ValueError giving the reason) is appended to `skipped` with its line number."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield parse(json.loads(line))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                reason = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else str(exc)
                skipped.append({"file": str(path), "line": number, "reason": reason})


def read_splits(train_file, eval_file, eval_fraction: float, seed: int, parse: Callable,
                skipped: list[dict]) -> dict[str, list]:
    """{"train", "eval"}: the records of both files, or of the train file with a seeded `eval_fraction` held out
    (chosen by content, so the split does not depend on line order)."""
    if eval_file:
        return {"train": list(read_records(Path(train_file), skipped, parse)),
                "eval": list(read_records(Path(eval_file), skipped, parse))}
    records = list(read_records(Path(train_file), skipped, parse))
    keys = [json.dumps(r, sort_keys=True) for r in records]
    held = set(split_train_eval(keys, eval_fraction, seed)[1]) if len(keys) >= 2 else set()
    return {"train": [r for r, k in zip(records, keys) if k not in held],
            "eval": [r for r, k in zip(records, keys) if k in held]}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def settings_fingerprint(settings: dict, inputs, tokenizer_path: Path) -> tuple[dict, str]:
    """(settings with the inputs' and tokenizer files' hashes, their fingerprint)."""
    settings = dict(settings, inputs=[[Path(p).name, _sha256(Path(p))] for p in inputs if p],
                    tokenizer=[[name, _sha256(p)] for name, p in tokenizer_files(tokenizer_path).items()])
    return settings, hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def existing_manifest(output: Path, data_format: str) -> dict | None:
    """The manifest of prepared data in `output`, None for an absent or empty directory; raises for others."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return None
    try:
        manifest = json.loads((output / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != data_format:
        raise PreparedDataError(f"{output} exists and holds no prepared data of this kind ({MANIFEST} with format "
                                f"{data_format!r}); remove it or choose another data.path")
    return manifest


def up_to_date(output: Path, data_format: str, fingerprint: str, log) -> dict | None:
    """The manifest when `output` already holds this data; None when it is free; raises when it holds other
    data."""
    existing = existing_manifest(output, data_format)
    if existing is None:
        return None
    if existing.get("fingerprint") == fingerprint:
        log(f"prepared data in {output} is up to date (skipped)")
        return existing
    raise PreparedDataError(f"{output} holds data prepared from different inputs or settings; remove it or choose "
                            "another data.path")


def read_and_encode(output: Path, files: tuple, eval_fraction: float, seed: int, parse: Callable,
                    encode: Callable, section: str, what: str, log) -> tuple[dict, list[dict]]:
    """({"train", "eval"}: `encode(records)` of each split, skipped lines) of `files` = (train, eval or ""); a
    split left with nothing (`encode`'s result has no `items`) is an error naming the file and its key."""
    train_file, eval_file = files
    skipped: list[dict] = []
    splits = read_splits(train_file, eval_file, eval_fraction, seed, parse, skipped)
    report_skipped(skipped, log)
    encoded = {name: encode(records) for name, records in splits.items()}
    for name, enc in encoded.items():
        if not enc.items:
            source, key = (eval_file, "eval_file") if name == "eval" and eval_file else (train_file, "train_file")
            raise PreparedDataError(f"no usable {name} {what} in {source} (skipped lines: {len(skipped)}, dropped: "
                                    f"{enc.dropped})", f"{section}.{key}")
    return encoded, skipped


def save_rows(directory: Path, rows: dict[str, np.ndarray]) -> dict:
    """Write the fields of one split; returns its row count, response tokens and packing efficiency."""
    directory.mkdir(parents=True)
    for field, array in rows.items():
        np.save(directory / f"{field}.npy", array)
    return {"rows": len(rows["tokens"]), "response_tokens": int(rows["loss_mask"].sum()),
            "packing_efficiency": float((rows["segment_ids"] > 0).mean())}


def commit(output: Path, manifest: dict, write: Callable[[Path], dict], tokenizer_path: Path) -> dict:
    """Write into a temporary sibling (`write(tmp)` returns the manifest's "splits"; the tokenizer's files are
    copied beside them) and rename it into place, so readers never see half of it."""
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        manifest = dict(manifest, splits=write(tmp))
        for name, path in tokenizer_files(tokenizer_path).items():
            shutil.copyfile(path, tmp / name)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            if output.exists():
                output.rmdir()  # empty when it was looked at
            os.rename(tmp, output)
        except OSError:  # another process of the job (same filesystem) committed first: fine if it is this data
            existing = existing_manifest(output, manifest["format"])
            if existing is None or existing.get("fingerprint") != manifest["fingerprint"]:
                raise PreparedDataError(f"{output} was written by another process with different data") from None
            return existing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def report_skipped(skipped: list[dict], log) -> None:
    """The first MAX_REPORTED_LINES skipped lines, one log line each, and how many there were."""
    for line in skipped[:MAX_REPORTED_LINES]:
        log(f"skipped {line['file']} line {line['line']}: {line['reason']}")
    if len(skipped) > MAX_REPORTED_LINES:
        log(f"skipped {len(skipped)} unusable lines in all")


class PreparedRows:
    """The packed rows of one split, random access by global row: epoch e = row // R visits the R rows in the
    order `default_rng([seed, e]).permutation(R)` (unshuffled: in order), so a batch is a pure function of
    (seed, step), as for pretraining (jaxllm.data.pipeline.TrainIterator and EvalBatches read it alike).
    `extra` names further per-row arrays ({field: .npy path}, leading axis R) that travel with the rows."""

    def __init__(self, directory: Path, split: str, seed: int = 0, shuffle: bool = True, extra: dict | None = None):
        paths = {f: Path(directory) / split / f"{f}.npy" for f in FIELDS}
        self._open(dict(paths, **{f: Path(p) for f, p in (extra or {}).items()}), seed, shuffle)

    def _open(self, paths: dict, seed: int, shuffle: bool) -> None:
        self.arrays = {f: np.load(p, mmap_mode="r") for f, p in paths.items()}
        self.rows_per_epoch, self.seq_len = self.arrays["tokens"].shape
        self.seed, self.shuffle = int(seed), bool(shuffle)

    def __len__(self) -> int:
        return self.rows_per_epoch

    def get_rows(self, rows) -> dict[str, np.ndarray]:
        rows = np.asarray(rows, np.int64)
        R = self.rows_per_epoch
        index = rows % R
        if self.shuffle:
            for epoch in np.unique(rows // R):
                at = rows // R == epoch
                index[at] = np.random.default_rng([self.seed, int(epoch)]).permutation(R)[index[at]]
        return {f: np.asarray(a[index]) for f, a in self.arrays.items()}

    def __getstate__(self):  # grain workers get the paths, not the memory maps
        return {"paths": {f: a.filename for f, a in self.arrays.items()}, "seed": self.seed,
                "shuffle": self.shuffle}

    def __setstate__(self, state):
        self._open(state["paths"], state["seed"], state["shuffle"])


PACK_WINDOW = 64


def first_fit(sizes: list[int], seq_len: int, seed: int, max_items: int | None = None) -> list[list[int]]:
    """Items (by index) grouped into rows of `seq_len` positions, in a seeded order, each into the first of the
    last `PACK_WINDOW` rows with room (and fewer than `max_items` items); a bounded window keeps packing linear."""
    order = np.random.default_rng(seed).permutation(len(sizes))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        need = sizes[i]
        lo = max(0, len(rows) - PACK_WINDOW)
        slot = next((r for r in range(lo, len(rows))
                     if free[r] >= need and (max_items is None or len(rows[r]) < max_items)), None)
        if slot is None:
            rows.append([])
            free.append(seq_len)
            slot = len(rows) - 1
        rows[slot].append(int(i))
        free[slot] -= need
    return rows


def empty_rows(count: int, seq_len: int) -> dict[str, np.ndarray]:
    return {f: np.zeros((count, seq_len), np.int32) for f in FIELDS}
