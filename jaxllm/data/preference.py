"""Preference pairs: JSON lines -> a shared prompt with a chosen and a rejected response -> tokens -> rows in
which a pair's two sequences sit side by side.

A line is {"prompt": str, "chosen": str, "rejected": str}, or the chat form {"prompt": [messages], "chosen":
[{"role": "assistant", "content": str}], "rejected": [...]} (TRL's conversational preference format; a plain
string also works for chosen / rejected); an optional "kind" (str) names the group the pair's accuracy is
reported in. A line that is not JSON, or lacks or mistypes a field, is counted and skipped with its line number.

Each response is rendered after the prompt with the SFT template (jaxllm/data/sft_template.py), so both sequences
start with the same prompt tokens. A sequence of n ids fills n positions of its row: tokens are the ids themselves
(the reward model scores the hidden state of the last one, as Hugging Face's LlamaForSequenceClassification does
on the same ids), targets the next ids (the last is 0), loss_mask 1 where that target is a response token (DPO's
summed log-probabilities). A sequence longer than half a row (seq_len // 2) is cut to that length
(`overlong="truncate"`; the pair is dropped when nothing of a response is left or both become identical) or its
pair is dropped ("drop"); both are counted.

Pairs are packed first fit (jaxllm/data/row_prep.py), up to `pairs_per_row` a row: pair p of a row has segment
2p + 1 (chosen) and 2p + 2 (rejected), so every pair lies within one row and one batch, and positions restart at 0
in each sequence (attention never crosses sequences). The prepared directory adds `eval_pairs.jsonl`: per
held-out pair its row, slot, kind and response lengths in tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from jaxllm.data import row_prep
from jaxllm.data.sft_template import ROLES, encode, render
from jaxllm.data.tokenizer import load_tokenizer, tokenizer_files

FORMAT = "jaxllm.preference"
VERSION = 1
EVAL_PAIRS = "eval_pairs.jsonl"


def _messages(value, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"field '{field}' must be a string or a non-empty list of messages")
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"each message of '{field}' needs a role in {list(ROLES)} and a string content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _response(value, field: str) -> str:
    if isinstance(value, str):
        return value
    messages = _messages(value, field)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ValueError(f"field '{field}' must be one assistant message")
    return messages[0]["content"]


def _pair(record) -> tuple[list[dict], str, str, str]:
    """(prompt messages, chosen, rejected, kind) of one parsed line; raises ValueError with the reason it is
    unusable."""
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise ValueError(f"missing field '{key}'")
    kind = record.get("kind", "default")
    if not isinstance(kind, str):
        raise ValueError("field 'kind' must be a string")
    prompt = record["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, "prompt")
    if messages[-1]["role"] == "assistant":
        raise ValueError("the prompt must not end with an assistant message")
    chosen, rejected = _response(record["chosen"], "chosen"), _response(record["rejected"], "rejected")
    if chosen == rejected:
        raise ValueError("chosen and rejected are the same")
    return messages, chosen, rejected, kind


def read_pairs(path: Path, skipped: list[dict]):
    """(prompt messages, chosen, rejected, kind) of every usable line of `path`; unusable ones go to `skipped`."""
    return row_prep.read_records(path, skipped, _pair)


class EncodedPairs:
    """Encoded pairs of one split: ((chosen ids, mask), (rejected ids, mask)) and their kinds; what was dropped."""

    def __init__(self):
        self.pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]] = []
        self.items = self.pairs
        self.kinds: list[str] = []
        self.truncated = 0
        self.dropped: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def encode_pairs(records, tokenizer, template: str, seq_len: int, overlong: str) -> EncodedPairs:
    """Render and encode pairs, applying the overlong rule (module docstring)."""
    out, limit = EncodedPairs(), seq_len // 2
    for messages, chosen, rejected, kind in records:
        sequences = [encode(render(template, messages + [{"role": "assistant", "content": response}], tokenizer),
                            tokenizer) for response in (chosen, rejected)]
        if any(len(ids) > limit for ids, _ in sequences):
            if overlong == "drop":
                out.drop("too_long")
                continue
            sequences = [(ids[:limit], mask[:limit]) for ids, mask in sequences]
            if not all(any(mask[1:]) for _, mask in sequences):
                out.drop("prompt_too_long")
                continue
            if sequences[0][0] == sequences[1][0]:
                out.drop("identical_after_truncation")
                continue
            out.truncated += 1
        out.pairs.append((sequences[0], sequences[1]))
        out.kinds.append(kind)
    return out


def pack_pairs(pairs, seq_len: int, seed: int, pairs_per_row: int) -> tuple[dict[str, np.ndarray], list[tuple]]:
    """(rows [R, seq_len] of every field, (row, slot) of each pair)."""
    rows = row_prep.first_fit([len(c[0]) + len(r[0]) for c, r in pairs], seq_len, seed, pairs_per_row)
    out = row_prep.empty_rows(len(rows), seq_len)
    where: list[tuple] = [None] * len(pairs)
    for r, members in enumerate(rows):
        at = 0
        for slot, i in enumerate(members):
            where[i] = (r, slot)
            for side, (ids, mask) in enumerate(pairs[i]):
                n = len(ids)
                window = slice(at, at + n)
                out["tokens"][r, window] = ids
                out["targets"][r, at:at + n - 1] = ids[1:]
                out["loss_mask"][r, at:at + n - 1] = mask[1:]
                out["segment_ids"][r, window] = 2 * slot + 1 + side
                out["positions"][r, window] = np.arange(n)
                at += n
    return out, where


def packed_pairs(enc: EncodedPairs, seq_len: int, seed: int, pairs_per_row: int) -> tuple[dict, list[dict]]:
    """(rows, one {"row", "slot", "kind", "chosen_tokens", "rejected_tokens"} per pair): lengths count response
    tokens."""
    rows, where = pack_pairs(enc.pairs, seq_len, seed, pairs_per_row)
    pairs = [{"row": row, "slot": slot, "kind": kind, "chosen_tokens": sum(c[1]), "rejected_tokens": sum(r[1])}
             for (row, slot), kind, (c, r) in zip(where, enc.kinds, enc.pairs)]
    return rows, pairs


def prepare_preference(output, *, train_file, eval_file, tokenizer_path, template: str, seq_len: int, overlong: str,
                       eval_fraction: float, seed: int, pairs_per_row: int, log: Callable[[str], None] = print) -> dict:
    """Prepare preference pairs into `output` (see the module docstring); returns the manifest. Raises
    PreparedDataError, or TemplateError when the template cannot render with this tokenizer."""
    output, tokenizer_path = Path(output), Path(tokenizer_path)
    settings, fingerprint = row_prep.settings_fingerprint(
        {"version": VERSION, "template": template, "seq_len": seq_len, "overlong": overlong, "seed": seed,
         "eval_fraction": None if eval_file else eval_fraction, "pairs_per_row": pairs_per_row},
        (train_file, eval_file), tokenizer_path)
    existing = row_prep.up_to_date(output, FORMAT, fingerprint, log)
    if existing is not None:
        return existing
    tokenizer = load_tokenizer(tokenizer_path)
    encoded, skipped = row_prep.read_and_encode(
        output, (train_file, eval_file), eval_fraction, seed, _pair,
        lambda records: encode_pairs(records, tokenizer, template, seq_len, overlong), "preference", "pairs", log)

    def write(tmp: Path) -> dict:
        splits_out = {}
        for name, enc in encoded.items():
            rows, pairs = packed_pairs(enc, seq_len, seed, pairs_per_row)
            splits_out[name] = dict(row_prep.save_rows(tmp / name, rows), pairs=len(enc.pairs),
                                    truncated=enc.truncated, dropped=enc.dropped,
                                    kinds={k: enc.kinds.count(k) for k in sorted(set(enc.kinds))})
            if name == "eval":
                (tmp / EVAL_PAIRS).write_text("".join(json.dumps(p) + "\n" for p in pairs))
        return splits_out

    manifest = row_prep.commit(output, {
        "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "settings": settings,
        "tokenizer": next(iter(tokenizer_files(tokenizer_path))), "vocab_size": tokenizer.vocab_size,
        "seq_len": seq_len, "pairs_per_row": pairs_per_row, "skipped_lines": len(skipped),
        "skipped": skipped[:row_prep.MAX_REPORTED_LINES]}, write, tokenizer_path)
    for name, s in manifest["splits"].items():
        log(f"preference {name}: {s['pairs']} pairs in {s['rows']} rows (packing {s['packing_efficiency']:.2f}), "
            f"{s['truncated']} truncated, dropped {s['dropped'] or 'none'}")
    return manifest


def eval_pairs(directory) -> list[dict]:
    """The held-out pairs: {"row", "slot", "kind", "chosen_tokens", "rejected_tokens"} each."""
    with open(Path(directory) / EVAL_PAIRS) as f:
        return [json.loads(line) for line in f]
