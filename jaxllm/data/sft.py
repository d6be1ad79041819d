"""Supervised fine-tuning data: JSON lines -> conversations -> tokens with a response mask -> packed rows.

A line is {"prompt": str, "response": str} or {"messages": [{"role": "system"|"user"|"assistant", "content":
str}, ...]} ending with an assistant turn; an optional "task" (str) names the group its evaluation metrics are
reported in. A line that is not JSON, or lacks or mistypes a field, is counted and skipped with its line number.

An example of n tokens (rendered by jaxllm/data/sft_template.py) trains on n - 1 positions: inputs ids[:-1],
targets ids[1:], loss_mask 1 where the target is a response token (the prompt and template tokens are 0). One
longer than seq_len + 1 tokens is cut to its first seq_len + 1 (`overlong="truncate"`; it is dropped anyway when
no response token is left) or dropped (`"drop"`), and counted.

Examples are packed into rows of seq_len positions in a seeded order, each into the first of the last
`PACK_WINDOW` rows with room (first fit over a bounded window keeps packing linear). segment_ids number the
examples of a row from 1 (0: padding) and positions restart at 0 in each, so attention never crosses examples.

The prepared directory (`data.path`):

    manifest.json                   settings, input hashes, counts (read, skipped by reason with line numbers,
                                    truncated, dropped), rows, packing efficiency; written last
    {train,eval}/<field>.npy        int32 [rows, seq_len] for tokens, targets, loss_mask, segment_ids, positions
    eval_examples.jsonl             held-out prompts (token ids) and reference responses, for generation metrics
    <tokenizer file(s)>             a copy of the tokenizer the ids come from

Preparing again with the same inputs and settings is skipped; different ones into the same directory is an
error (SFTDataError), never an overwrite.
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
from jaxllm.data.sft_template import ROLES, encode, prompt_pieces, render
from jaxllm.data.tokenizer import load_tokenizer, tokenizer_files

FORMAT = "jaxllm.sft"
VERSION = 1
MANIFEST = "manifest.json"
EVAL_EXAMPLES = "eval_examples.jsonl"
PACK_WINDOW = 64
MAX_REPORTED_LINES = 20  # skipped lines listed in the manifest (all are counted)


class SFTDataError(ValueError):
    """A problem with SFT inputs or the prepared directory, as one line naming the file; `key` is the setting
    that names it."""

    def __init__(self, message: str, key: str = "data.path"):
        super().__init__(message)
        self.key = key


def _conversation(record) -> tuple[list[dict], str]:
    """(messages, task) of one parsed line; raises ValueError with the reason it is unusable."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    task = record.get("task", "default")
    if not isinstance(task, str):
        raise ValueError("field 'task' must be a string")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("field 'messages' must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs a role in {list(ROLES)} and a string content")
        if messages[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's")
        return [{"role": m["role"], "content": m["content"]} for m in messages], task
    for key in ("prompt", "response"):
        if key not in record:
            raise ValueError(f"missing field '{key}'")
        if not isinstance(record[key], str):
            raise ValueError(f"field '{key}' must be a string")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}], task


def read_examples(path: Path, skipped: list[dict]) -> Iterator[tuple[list[dict], str]]:
    """(messages, task) of every usable line of `path`; each unusable one is appended to `skipped`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield _conversation(json.loads(line))
            except ValueError as exc:  # json.JSONDecodeError is a ValueError too
                reason = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else str(exc)
                skipped.append({"file": str(path), "line": number, "reason": reason})


class Encoded:
    """Encoded examples of one split and what happened to the others."""

    def __init__(self):
        self.examples: list[tuple[list[int], list[int]]] = []  # (ids, response mask)
        self.prompts: list[dict] = []  # evaluation: prompt ids, reference, task
        self.truncated = 0
        self.dropped: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def _eval_example(pieces, messages, task: str, tokenizer) -> dict:
    return {"task": task, "prompt_ids": encode(prompt_pieces(pieces), tokenizer)[0],
            "reference": messages[-1]["content"]}


def task_examples(path, tokenizer, template: str) -> tuple[list[dict], list[dict]]:
    """(evaluation examples {"task", "prompt_ids", "reference"}, skipped lines) of a JSON-lines file."""
    skipped: list[dict] = []
    examples = [_eval_example(render(template, messages, tokenizer), messages, task, tokenizer)
                for messages, task in read_examples(Path(path), skipped)]
    return examples, skipped


def encode_examples(conversations, tokenizer, template: str, seq_len: int, overlong: str) -> Encoded:
    """Render and encode conversations, applying the overlong rule."""
    out = Encoded()
    for messages, task in conversations:
        pieces = render(template, messages, tokenizer)
        ids, mask = encode(pieces, tokenizer)
        if not any(mask[1:]):
            out.drop("empty_response")
            continue
        out.prompts.append(_eval_example(pieces, messages, task, tokenizer))
        if len(ids) > seq_len + 1:
            if overlong == "drop":
                out.drop("too_long")
                continue
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            if not any(mask[1:]):
                out.drop("prompt_too_long")
                continue
            out.truncated += 1
        out.examples.append((ids, mask))
    return out


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """Rows [R, seq_len] of every field (see the module docstring for the rule)."""
    order = np.random.default_rng(seed).permutation(len(examples))
    rows: list[list[int]] = []  # example indices per row
    free: list[int] = []
    for i in order:
        need = len(examples[i][0]) - 1
        lo = max(0, len(rows) - PACK_WINDOW)
        slot = next((r for r in range(lo, len(rows)) if free[r] >= need), None)
        if slot is None:
            rows.append([])
            free.append(seq_len)
            slot = len(rows) - 1
        rows[slot].append(int(i))
        free[slot] -= need
    out = {f: np.zeros((len(rows), seq_len), np.int32) for f in FIELDS}
    for r, members in enumerate(rows):
        at = 0
        for segment, i in enumerate(members, start=1):
            ids, mask = examples[i]
            n = len(ids) - 1
            window = slice(at, at + n)
            out["tokens"][r, window] = ids[:-1]
            out["targets"][r, window] = ids[1:]
            out["loss_mask"][r, window] = mask[1:]
            out["segment_ids"][r, window] = segment
            out["positions"][r, window] = np.arange(n)
            at += n
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def prepare_sft(output, *, train_file, eval_file, tokenizer_path, template: str, seq_len: int, overlong: str,
                eval_fraction: float, seed: int, log: Callable[[str], None] = print) -> dict:
    """Prepare SFT data into `output` (see the module docstring); returns the manifest. Raises SFTDataError, or
    TemplateError when the template cannot render with this tokenizer."""
    output, tokenizer_path = Path(output), Path(tokenizer_path)
    inputs = [Path(p) for p in (train_file, eval_file) if p]
    settings = {"version": VERSION, "template": template, "seq_len": seq_len, "overlong": overlong,
                "eval_fraction": None if eval_file else eval_fraction, "seed": seed,
                "inputs": [[p.name, _sha256(p)] for p in inputs],
                "tokenizer": [[name, _sha256(p)] for name, p in tokenizer_files(tokenizer_path).items()]}
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    existing = _existing(output)
    if existing is not None:
        if existing.get("fingerprint") == fingerprint:
            log(f"SFT data in {output} is up to date (skipped)")
            return existing
        raise SFTDataError(f"{output} holds SFT data prepared from different inputs or settings; remove it or "
                           "choose another data.path")
    tokenizer = load_tokenizer(tokenizer_path)
    skipped: list[dict] = []
    if eval_file:
        splits = {"train": list(read_examples(Path(train_file), skipped)),
                  "eval": list(read_examples(Path(eval_file), skipped))}
    else:
        conversations = list(read_examples(Path(train_file), skipped))
        keys = [json.dumps(m, sort_keys=True) for m, _ in conversations]
        held = set(split_train_eval(keys, eval_fraction, seed)[1]) if len(keys) >= 2 else set()
        splits = {"train": [c for c, k in zip(conversations, keys) if k not in held],
                  "eval": [c for c, k in zip(conversations, keys) if k in held]}
    for line in skipped[:MAX_REPORTED_LINES]:
        log(f"skipped {line['file']} line {line['line']}: {line['reason']}")
    encoded = {name: encode_examples(convs, tokenizer, template, seq_len, overlong) for name, convs in splits.items()}
    for name, enc in encoded.items():
        if not enc.examples:
            source, key = (eval_file, "sft.eval_file") if name == "eval" and eval_file else (train_file, "sft.train_file")
            raise SFTDataError(f"no usable {name} examples in {source} (skipped lines: {len(skipped)}, dropped: "
                               f"{enc.dropped})", key)
    manifest = _write(output, encoded, tokenizer_path, seq_len, seed, {
        "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "settings": settings,
        "tokenizer": next(iter(tokenizer_files(tokenizer_path))), "vocab_size": tokenizer.vocab_size, "seq_len": seq_len,
        "skipped_lines": len(skipped), "skipped": skipped[:MAX_REPORTED_LINES]})
    for name, s in manifest["splits"].items():
        log(f"SFT {name}: {s['examples']} examples in {s['rows']} rows (packing {s['packing_efficiency']:.2f}), "
            f"{s['truncated']} truncated, dropped {s['dropped'] or 'none'}")
    if skipped:
        log(f"skipped {len(skipped)} unusable lines (listed in {output / MANIFEST})")
    return manifest


def _existing(output: Path) -> dict | None:
    """The manifest of prepared data in `output`, None for an absent or empty directory; raises for others."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return None
    try:
        manifest = json.loads((output / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SFTDataError(f"{output} exists and holds no prepared SFT data ({MANIFEST} with format {FORMAT!r}); "
                           "remove it or choose another data.path")
    return manifest


def _write(output: Path, encoded: dict[str, Encoded], tokenizer_path: Path, seq_len: int, seed: int,
           manifest: dict) -> dict:
    """Write everything into a temporary sibling and rename it into place (readers never see half of it)."""
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        splits = {}
        for name, enc in encoded.items():
            rows = pack(enc.examples, seq_len, seed)
            (tmp / name).mkdir(parents=True)
            for field, array in rows.items():
                np.save(tmp / name / f"{field}.npy", array)
            splits[name] = {"examples": len(enc.examples), "rows": len(rows["tokens"]),
                            "response_tokens": int(rows["loss_mask"].sum()),
                            "packing_efficiency": float((rows["segment_ids"] > 0).mean()),
                            "truncated": enc.truncated, "dropped": enc.dropped}
        with open(tmp / EVAL_EXAMPLES, "w") as f:
            for prompt in encoded["eval"].prompts:
                f.write(json.dumps(prompt) + "\n")
        for name, path in tokenizer_files(tokenizer_path).items():
            shutil.copyfile(path, tmp / name)
        manifest = dict(manifest, splits=splits)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        output.parent.mkdir(parents=True, exist_ok=True)
        try:
            if output.exists():
                output.rmdir()  # empty when _existing looked
            os.rename(tmp, output)
        except OSError:  # another process of the job (same filesystem) committed first: fine if it is this data
            existing = _existing(output)
            if existing is None or existing.get("fingerprint") != manifest["fingerprint"]:
                raise SFTDataError(f"{output} was written by another process with different SFT data") from None
            return existing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


class SFTRows:
    """The packed rows of one split, random access by global row: epoch e = row // R visits the R rows in the
    order `default_rng([seed, e]).permutation(R)` (unshuffled: in order), so a batch is a pure function of
    (seed, step), as for pretraining (jaxllm.data.pipeline.TrainIterator and EvalBatches read it alike)."""

    def __init__(self, directory: Path, split: str, seed: int = 0, shuffle: bool = True):
        self.arrays = {f: np.load(Path(directory) / split / f"{f}.npy", mmap_mode="r") for f in FIELDS}
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
        return {f: np.asarray(a[index], np.int32) for f, a in self.arrays.items()}

    def __getstate__(self):  # grain workers get the paths, not the memory maps
        return {"paths": {f: a.filename for f, a in self.arrays.items()}, "seed": self.seed,
                "shuffle": self.shuffle}

    def __setstate__(self, state):
        self.arrays = {f: np.load(p, mmap_mode="r") for f, p in state["paths"].items()}
        self.rows_per_epoch, self.seq_len = self.arrays["tokens"].shape
        self.seed, self.shuffle = state["seed"], state["shuffle"]


def eval_prompts(directory) -> list[dict]:
    """The held-out prompts: {"task", "prompt_ids", "reference"} per example."""
    with open(Path(directory) / EVAL_EXAMPLES) as f:
        return [json.loads(line) for line in f]
