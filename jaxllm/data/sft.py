"""Supervised fine-tuning data: JSON lines -> conversations -> tokens with a response mask -> packed rows.

A line is {"prompt": str, "response": str} or {"messages": [{"role": "system"|"user"|"assistant", "content":
str}, ...]} ending with an assistant turn; an optional "task" (str) names the group its evaluation metrics are
reported in. A line that is not JSON, or lacks or mistypes a field, is counted and skipped with its line number.

An example of n tokens (rendered by jaxllm/data/sft_template.py) trains on n - 1 positions: inputs ids[:-1],
targets ids[1:], loss_mask 1 where the target is a response token (the prompt and template tokens are 0). One
longer than seq_len + 1 tokens is cut to its first seq_len + 1 (`overlong="truncate"`; it is dropped anyway when
no response token is left) or dropped (`"drop"`), and counted.

Examples are packed into rows of seq_len positions in a seeded order, first fit over a bounded window
(jaxllm/data/row_prep.py, which also holds the manifest, fingerprint and atomic commit). segment_ids number the
examples of a row from 1 (0: padding) and positions restart at 0 in each, so attention never crosses examples.

The prepared directory (`data.path`):

    manifest.json                   settings, input hashes, counts (read, skipped by reason with line numbers,
                                    truncated, dropped), rows, packing efficiency; written last
    {train,eval}/<field>.npy        int32 [rows, seq_len] for tokens, targets, loss_mask, segment_ids, positions
    eval_examples.jsonl             held-out prompts (token ids) and reference responses, for generation metrics
    <tokenizer file(s)>             a copy of the tokenizer the ids come from

Preparing again with the same inputs and settings is skipped; different ones into the same directory is an
error (PreparedDataError), never an overwrite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import json

import numpy as np

from jaxllm.data import row_prep
from jaxllm.data.sft_template import checked_messages, encode, prompt_pieces, render
from jaxllm.data.tokenizer import load_tokenizer, tokenizer_files

FORMAT = "jaxllm.sft"
VERSION = 1
EVAL_EXAMPLES = "eval_examples.jsonl"


def _conversation(record) -> tuple[list[dict], str]:
    """(messages, task) of one parsed line; raises ValueError with the reason it is unusable."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    task = record.get("task", "default")
    if not isinstance(task, str):
        raise ValueError("field 'task' must be a string")
    if "messages" in record:
        return checked_messages(record["messages"], "assistant", "the last message must be the assistant's"), task
    for key in ("prompt", "response"):
        if key not in record:
            raise ValueError(f"missing field '{key}'")
        if not isinstance(record[key], str):
            raise ValueError(f"field '{key}' must be a string")
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}], task


def read_examples(path: Path, skipped: list[dict]) -> Iterator[tuple[list[dict], str]]:
    """(messages, task) of every usable line of `path`; each unusable one is appended to `skipped`."""
    return row_prep.read_records(path, skipped, _conversation)


class Encoded:
    """Encoded examples of one split and what happened to the others."""

    def __init__(self):
        self.examples: list[tuple[list[int], list[int]]] = []  # (ids, response mask)
        self.items = self.examples
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
    rows = row_prep.first_fit([len(ids) - 1 for ids, _ in examples], seq_len, seed)
    out = row_prep.empty_rows(len(rows), seq_len)
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


def prepare_sft(output, *, train_file, eval_file, tokenizer_path, template: str, seq_len: int, overlong: str,
                eval_fraction: float, seed: int, log: Callable[[str], None] = print) -> dict:
    """Prepare SFT data into `output` (see the module docstring); returns the manifest. Raises PreparedDataError,
    or TemplateError when the template cannot render with this tokenizer."""
    output, tokenizer_path = Path(output), Path(tokenizer_path)
    settings, fingerprint = row_prep.settings_fingerprint(
        {"version": VERSION, "template": template, "seq_len": seq_len, "overlong": overlong,
         "eval_fraction": None if eval_file else eval_fraction, "seed": seed}, (train_file, eval_file), tokenizer_path)
    existing = row_prep.up_to_date(output, FORMAT, fingerprint, log)
    if existing is not None:
        return existing
    tokenizer = load_tokenizer(tokenizer_path)
    encoded, skipped = row_prep.read_and_encode(
        output, (train_file, eval_file), eval_fraction, seed, _conversation,
        lambda convs: encode_examples(convs, tokenizer, template, seq_len, overlong), "sft", "examples", log)

    def write(tmp: Path) -> dict:
        with open(tmp / EVAL_EXAMPLES, "w") as f:
            for prompt in encoded["eval"].prompts:
                f.write(json.dumps(prompt) + "\n")
        return {name: dict(row_prep.save_rows(tmp / name, pack(enc.examples, seq_len, seed)),
                           examples=len(enc.examples), truncated=enc.truncated, dropped=enc.dropped)
                for name, enc in encoded.items()}

    manifest = row_prep.commit(output, {
        "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "settings": settings,
        "tokenizer": next(iter(tokenizer_files(tokenizer_path))), "vocab_size": tokenizer.vocab_size, "seq_len": seq_len,
        "skipped_lines": len(skipped), "skipped": skipped[:row_prep.MAX_REPORTED_LINES]}, write, tokenizer_path)
    for name, s in manifest["splits"].items():
        log(f"SFT {name}: {s['examples']} examples in {s['rows']} rows (packing {s['packing_efficiency']:.2f}), "
            f"{s['truncated']} truncated, dropped {s['dropped'] or 'none'}")
    return manifest


def eval_prompts(directory) -> list[dict]:
    """The held-out prompts: {"task", "prompt_ids", "reference"} per example."""
    with open(Path(directory) / EVAL_EXAMPLES) as f:
        return [json.loads(line) for line in f]
